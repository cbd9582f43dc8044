"""Workers that persist across epochs yet draw what fresh ones draw.

The reference in each test is a plain ``DataLoader(..., persistent_workers=False)`` with the same arguments,
built in the test: every epoch's items (the index, the worker's id and ``get_worker_info().seed``, a numpy,
a ``random`` and a torch draw made in the worker, and what the user's ``worker_init_fn`` drew at the epoch's
start), and what the main process draws after each epoch, and the ``generator``'s state, must be equal; the
loaders of ``fast_loader``, ``tune_loader`` and ``distributed()`` must also keep their worker processes.
"""

from __future__ import annotations

import functools
import itertools
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, TensorDataset

from speedups import SpeedupsWarning, distributed, fast_loader, tune_loader
from speedups.data.persistence import reseeds_workers
from tests._loading_data import (
    BatchedProbe,
    EagerBatches,
    EagerShuffle,
    EpochItems,
    EpochProbe,
    Stream,
    record_init,
)

FORK = "fork" in torch.multiprocessing.get_all_start_methods()
pytestmark = pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")
EPOCHS = 3


def _rows(batch: Any) -> list[tuple[int, ...]]:
    """The EpochProbe items of a batch (one item when automatic batching is off)."""
    if isinstance(batch[0], int):  # one item, its tuple converted to a list
        return [tuple(batch)]
    return [tuple(int(v) for v in item) for item in zip(*batch, strict=True)]


class Run:
    """What a loop over ``EPOCHS`` epochs sees, from seed 0 in torch, ``random`` and numpy."""

    def __init__(self, make: Callable[[], DataLoader], *, set_epoch: bool = False) -> None:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        self.loader = make()
        self.epochs: list[list[tuple[int, ...]]] = []  # each epoch's items, their pid left out
        self.after: list[Any] = []  # the main process's draws and the generator's state after each epoch
        self.pids: list[set[int]] = []  # the processes that loaded each epoch
        for epoch in range(EPOCHS):
            if set_epoch:
                self.loader.sampler.set_epoch(epoch)
            rows = [row for batch in self.loader for row in _rows(batch)]
            self.epochs.append([row[:7] for row in rows])
            self.pids.append({row[7] for row in rows})
            self.after.append(_after_epoch(self.loader))


def _after_epoch(loader: DataLoader) -> tuple[Any, ...]:
    generator = None if loader.generator is None else loader.generator.get_state().tolist()
    return torch.rand(3).tolist(), random.random(), float(np.random.rand()), generator


def _assert_same(mine: Run, plain: Run) -> None:
    for epoch in range(EPOCHS):
        assert mine.epochs[epoch] == plain.epochs[epoch], f"epoch {epoch}: the items differ"
        assert mine.after[epoch] == plain.after[epoch], f"after epoch {epoch}: the main draws differ"
    seeds = [{row[2] for row in epoch} for epoch in plain.epochs]
    assert all(a.isdisjoint(b) for a, b in itertools.pairwise(seeds)), "the reference reseeds every epoch"


def _assert_persisted(run: Run) -> None:
    assert run.loader.persistent_workers and reseeds_workers(run.loader)
    assert run.pids[0] == run.pids[1] == run.pids[2], "workers restarted"


# ------------------------------------------------------------------------------------------- fast_loader
@pytest.mark.parametrize("init", [None, record_init], ids=["no init", "worker_init_fn"])
@pytest.mark.parametrize("generator", [False, True], ids=["global RNG", "generator="])
@pytest.mark.parametrize("workers", [1, 2])
def test_each_epoch_is_a_fresh_dataloaders_with_the_workers_kept(workers: int, generator: bool, init) -> None:
    """The batches with augmentation drawn in the workers from torch, random and numpy, the worker seed,
    what worker_init_fn drew (run again each epoch), and the main process's draws after each epoch."""
    data = EpochProbe(10)

    def kw() -> dict[str, Any]:
        extra: dict[str, Any] = {"num_workers": workers, "multiprocessing_context": "fork"}
        if generator:
            extra["generator"] = torch.Generator().manual_seed(5)
        if init is not None:
            extra["worker_init_fn"] = init
        return extra

    plain = Run(lambda: DataLoader(data, 3, shuffle=True, **kw()))
    mine = Run(lambda: fast_loader(data, 3, shuffle=True, **kw()))
    _assert_same(mine, plain)
    _assert_persisted(mine)
    assert plain.pids[0].isdisjoint(plain.pids[1])  # the reference's workers are fresh each epoch
    if init is not None:
        assert all(row[6] // 1000 == 100 + row[1] for epoch in mine.epochs for row in epoch)


def _batch_sampler() -> BatchSampler:
    return BatchSampler(RandomSampler(range(10)), 3, drop_last=False)


@pytest.mark.parametrize(
    ("dataset", "args"),
    [
        (EpochProbe, lambda: {"batch_size": None, "shuffle": True}),
        (EpochProbe, lambda: {"batch_size": 1, "batch_sampler": _batch_sampler()}),
        (BatchedProbe, lambda: {"batch_size": 3, "shuffle": True}),
        (BatchedProbe, lambda: {"batch_size": 1, "batch_sampler": _batch_sampler()}),
        (EpochProbe, lambda: {"batch_size": None, "sampler": EagerShuffle(10)}),
        (EpochProbe, lambda: {"batch_size": 3, "sampler": EagerShuffle(10)}),
        (EpochProbe, lambda: {"batch_size": 1, "batch_sampler": EagerBatches(10)}),
    ],
    ids=[
        "batch_size=None",
        "batch_sampler",
        "own __getitems__",
        "own __getitems__, batch_sampler",
        "eager sampler, batch_size=None",
        "eager sampler in batches",
        "eager batch_sampler",
    ],
)
def test_every_way_of_ordering_draws_in_a_fresh_dataloaders_order(dataset, args) -> None:
    """An eager sampler draws its order from the global RNG when iter() is called: a fresh iterator calls
    iter() on what it reads directly (the sampler without batching, or the batch sampler) once before its
    base-seed draw and once after, and a sampler inside DataLoader's BatchSampler after it."""
    data = dataset(10)
    kw = {"num_workers": 2, "multiprocessing_context": "fork", "worker_init_fn": record_init}
    plain = Run(lambda: DataLoader(data, **(args() | kw)))
    mine = Run(lambda: fast_loader(data, **(args() | kw)))
    _assert_same(mine, plain)
    _assert_persisted(mine)
    if dataset is BatchedProbe:
        assert all(row[6] < 0 for epoch in mine.epochs for row in epoch)  # its own __getitems__ loaded them


def test_sample_seeds_with_a_generator_of_the_users_persist_exactly() -> None:
    """fast_loader(sample_seeds=True, generator=g): the base seed comes from g each epoch, as fresh workers
    draw it (hand-computed below); the items are fresh workers' (persistent_workers=False)."""
    data = EpochProbe(10)

    def make(**extra: Any) -> DataLoader:
        g = torch.Generator().manual_seed(5)
        return fast_loader(
            data,
            3,
            shuffle=True,
            sample_seeds=True,
            generator=g,
            num_workers=2,
            multiprocessing_context="fork",
            worker_init_fn=record_init,
            **extra,
        )

    fresh = Run(functools.partial(make, persistent_workers=False))
    mine = Run(make)
    _assert_same(mine, fresh)
    _assert_persisted(mine)
    g = torch.Generator().manual_seed(5)
    for epoch, after in zip(mine.epochs, mine.after, strict=True):
        base = int(torch.empty((), dtype=torch.int64).random_(generator=g).item())
        assert {row[2] - row[1] for row in epoch} == {base}  # get_worker_info().seed: base seed + worker id
        assert after[3] == g.get_state().tolist()  # one draw per epoch: the order is (seed, epoch)'s


def test_fresh_workers_where_live_ones_cannot_match_and_torchs_own_when_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpeedupsWarning)  # a stream read by 2 workers: said elsewhere
        stream = fast_loader(Stream(4), 2, num_workers=2)
    assert stream.persistent_workers is False  # its items have no index to carry the seed
    assert fast_loader(EpochItems(4), 2, num_workers=2).persistent_workers is False  # set_epoch state
    data = EpochProbe(6)
    asked = fast_loader(data, 2, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    assert asked.persistent_workers and asked.dataset is data and not reseeds_workers(asked)
    first, second = ([row[2] for b in asked for row in _rows(b)] for _ in range(2))
    assert set(first) == set(second)  # torch's own persistent workers keep their seed


def test_an_attribute_reassigned_after_the_workers_started_restarts_them_with_one_warning() -> None:
    """Workers keep the dataset they copied: after `data.flag = ...` the next epoch's workers start afresh
    (as a plain DataLoader's would, copying it), with one warning naming the attribute at the loop; an equal
    value assigned again changes nothing (tests/data/test_changing_datasets.py: every kind of change)."""
    data = EpochProbe(4)
    loader = fast_loader(data, 2, num_workers=1, multiprocessing_context="fork")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        first = {row[7] for b in loader for row in _rows(b)}
        data.n = 4  # the same value again: nothing changed
        assert {row[7] for b in loader for row in _rows(b)} == first
    data.flag = 1
    with pytest.warns(SpeedupsWarning, match=r"dataset\.flag changed in the main process") as caught:
        second = {row[7] for b in loader for row in _rows(b)}
        data.flag = 2
        third = {row[7] for b in loader for row in _rows(b)}
    assert first != second != third  # fresh workers at each epoch whose dataset changed
    assert len(caught) == 1 and caught[0].filename == __file__  # once, pointing at the loop


# ----------------------------------------------------------------------------------- tune_loader, distributed
def test_tune_loader_returns_workers_that_persist_exactly() -> None:
    data = EpochProbe(10)

    def plain_with(workers: int) -> Callable[[], DataLoader]:
        g = torch.Generator().manual_seed(5)
        return lambda: DataLoader(
            data, 3, shuffle=True, num_workers=workers, generator=g, worker_init_fn=record_init
        )

    tuned, report = tune_loader(
        plain_with(0)(), max_seconds=1, candidates=[{"num_workers": 2}], progress=False
    )
    assert tuned.num_workers == 2 and report.chosen["persistent_workers"] is True
    mine = Run(lambda: tuned)
    _assert_same(mine, Run(plain_with(2)))
    _assert_persisted(mine)
    # persisting exactly is drawing per epoch, as 0 workers do: 0 workers may be timed and chosen
    exact = fast_loader(data, 3, shuffle=True, num_workers=2, seed=5, multiprocessing_context="fork")
    tuned, report = tune_loader(exact, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    assert tuned.num_workers == 0 and "not timed" not in report.reason


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (0, 2)])
@pytest.mark.parametrize("generator", [False, True], ids=["global RNG", "generator="])
def test_distributed_over_fast_loader_is_a_fresh_dataloader_with_a_distributed_sampler(
    rank: int, world_size: int, generator: bool
) -> None:
    data = EpochProbe(12)

    def kw() -> dict[str, Any]:
        extra: dict[str, Any] = {
            "num_workers": 2,
            "worker_init_fn": record_init,
            "multiprocessing_context": "fork",
        }
        return extra | ({"generator": torch.Generator().manual_seed(5)} if generator else {})

    def plain() -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        return DataLoader(data, 3, sampler=sampler, **kw())

    def mine() -> DataLoader:
        return distributed(fast_loader(data, 3, shuffle=True, **kw()), rank=rank, world_size=world_size)

    ours = Run(mine)
    _assert_same(ours, Run(plain, set_epoch=True))
    _assert_persisted(ours)


# ------------------------------------------------------------------------------------------------- resume
def _distributed_loader() -> DataLoader:
    data = EpochProbe(12)  # 4 batches of 3 per epoch
    loader = fast_loader(
        data, 3, shuffle=True, num_workers=2, worker_init_fn=record_init, multiprocessing_context="fork"
    )
    return distributed(loader, rank=0, world_size=1)


def _four_epochs_saving(
    loader: Any, batches: int, width: int
) -> tuple[list[list[tuple[int, ...]]], list[Any], tuple[dict[str, Any], torch.Tensor] | None]:
    """Four epochs of ``loader``: each epoch's rows (their first ``width`` fields), the main process's draws
    after each epoch, and the checkpoint (loader state, global RNG) taken in epoch 1 after ``batches``."""
    seen: list[list[tuple[int, ...]]] = []
    after: list[Any] = []
    saved = None
    for epoch in range(4):
        rows: list[tuple[int, ...]] = []
        if epoch == 1 and batches == 0:
            saved = loader.state_dict(), torch.get_rng_state()
        for i, batch in enumerate(loader):
            rows += [row[:width] for row in _rows(batch)]
            if epoch == 1 and i + 1 == batches:
                saved = loader.state_dict(), torch.get_rng_state()
        seen.append(rows)
        after.append(torch.rand(3).tolist())
    return seen, after, saved


@pytest.mark.parametrize("into", ["a fresh loader", "the same loader"])
@pytest.mark.parametrize("batches", [0, 2], ids=["at an epoch boundary", "mid-epoch"])
def test_a_resume_in_a_later_epoch_continues_the_uninterrupted_run(batches: int, into: str) -> None:
    """A checkpoint (loader state and global RNG) taken in epoch 1, after `batches` batches, resumed: the
    rest of the run is the uninterrupted one's. Mid-epoch, the order and each item's worker and worker seed
    are exact, but not the workers' draws in that epoch (the skipped batches are never loaded, so the
    workers' streams are not as far along); from the next epoch on, everything is."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    loader = _distributed_loader()
    seen, after, saved = _four_epochs_saving(loader, batches, 7)
    assert saved is not None and saved[0]["epoch"] == 1 and saved[0]["batches"] == batches
    assert (saved[0]["seed_state"] is not None) == (batches > 0)

    resumed = _distributed_loader() if into == "a fresh loader" else loader
    torch.set_rng_state(saved[1])
    resumed.load_state_dict(saved[0])
    for epoch in range(1, 4):
        rows = [row[:7] for batch in resumed for row in _rows(batch)]
        want = seen[epoch][3 * batches :] if epoch == 1 else seen[epoch]
        if epoch == 1 and batches:
            assert [r[:3] for r in rows] == [r[:3] for r in want], "the order, workers and worker seeds"
        else:
            assert rows == want, f"epoch {epoch}"
        assert torch.rand(3).tolist() == after[epoch], f"the main draws after epoch {epoch}"


def _over_torchs_persistent_workers(data: EpochProbe) -> DataLoader:
    loader = DataLoader(data, 2, shuffle=True, persistent_workers=True, **_TWO_FORK_WORKERS)
    return distributed(loader, rank=0, world_size=1)


_TWO_FORK_WORKERS: dict[str, Any] = {
    "num_workers": 2,
    "worker_init_fn": record_init,
    "multiprocessing_context": "fork",
}


@pytest.mark.parametrize("into", ["a fresh loader", "the same loader"])
@pytest.mark.parametrize("batches", [0, 4], ids=["at an epoch boundary", "mid-epoch"])
def test_a_resume_over_torchs_own_persistent_workers_replays_their_one_base_seed(batches: int, into: str):
    """distributed(DataLoader(..., persistent_workers=True)) keeps torch's own persistent workers, which draw
    their base seed once, in epoch 0: each epoch's order, workers and worker seeds are those of torch's
    DataLoader with a DistributedSampler; a run resumed in epoch 1 (12 batches an epoch) seeds the workers
    it starts with that epoch-0 seed (replayed from the checkpoint, the global RNG untouched) and goes on
    as the uninterrupted run, batch for batch (the workers' own draws restart: they are new processes)."""
    data = EpochProbe(24)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain = DataLoader(data, 2, sampler=sampler, persistent_workers=True, **_TWO_FORK_WORKERS)
    reference = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        reference.append([row[:3] for batch in plain for row in _rows(batch)])

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    loader = _over_torchs_persistent_workers(data)
    seen, after, saved = _four_epochs_saving(loader, batches, 3)
    assert seen == reference, "torch's own persistent workers: one base seed for every epoch"
    assert len({row[2] - row[1] for epoch in seen for row in epoch}) == 1
    assert saved is not None and saved[0]["seed_state"] is not None

    resumed = _over_torchs_persistent_workers(data) if into == "a fresh loader" else loader
    torch.set_rng_state(saved[1])
    resumed.load_state_dict(saved[0])
    again = resumed.state_dict()["seed_state"]  # a checkpoint taken before the resumed pass: the same seed
    assert again is not None and torch.equal(again, saved[0]["seed_state"])
    for epoch in range(1, 4):
        rows = [row[:3] for batch in resumed for row in _rows(batch)]
        want = seen[epoch][2 * batches :] if epoch == 1 else seen[epoch]
        right = sum(a == b for a, b in zip(rows[::2], want[::2], strict=True))
        assert rows == want, f"epoch {epoch}: {right} of {len(want) // 2} batches right"
        assert torch.rand(3).tolist() == after[epoch], f"the main draws after epoch {epoch}"


# -------------------------------------------------------------------------------------------------- spawn
@pytest.mark.slow
def test_spawned_workers_persist_exactly() -> None:
    data = EpochProbe(4)

    def kw() -> dict[str, Any]:
        g = torch.Generator().manual_seed(3)
        return {
            "num_workers": 1,
            "multiprocessing_context": "spawn",
            "worker_init_fn": record_init,
            "generator": g,
        }

    mine = Run(lambda: fast_loader(data, 2, shuffle=True, **kw()))
    _assert_same(mine, Run(lambda: DataLoader(data, 2, shuffle=True, **kw())))
    _assert_persisted(mine)


@pytest.mark.parametrize("wrap", ["fast_loader", "distributed(fast_loader)"])
def test_a_loader_dropped_in_the_middle_of_a_pass_is_freed_at_once_and_its_workers_end(wrap: str) -> None:
    """No reference cycle holds the loader: dropped mid-pass (a `break`, early stopping), it goes at once
    and its iterator's shutdown reaches the workers. In a cycle, the collector freed the iterator's queues
    first and the shutdown waited 20 s for workers that never heard it."""
    import gc
    import multiprocessing
    import weakref

    data = TensorDataset(torch.arange(40.0))
    enabled = gc.isenabled()
    gc.disable()
    try:
        loader = fast_loader(data, 2, shuffle=True, num_workers=2, seed=0)
        if wrap != "fast_loader":
            loader = distributed(loader, rank=1, world_size=2)
        before = set(multiprocessing.active_children())
        list(loader)  # a whole pass: the persistent workers' later passes are the ones at issue
        it = iter(loader)
        next(it)
        workers = [w for w in multiprocessing.active_children() if w not in before]
        del it
        ref = weakref.ref(loader)
        del loader
        assert ref() is None  # freed by its last reference, without a collection
        assert workers and not any(w.is_alive() for w in workers)  # the shutdown joined them
    finally:
        if enabled:
            gc.enable()

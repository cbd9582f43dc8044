"""fast_loader: defaults, worker seeding, pickling under spawn/forkserver checked before any worker starts."""

from __future__ import annotations

import functools
import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from speedups import SpeedupsError, SpeedupsWarning, fast_loader
from speedups.data.workers import seed_worker
from tests._loading_data import (
    Augmented,
    EpochItems,
    SeedProbe,
    Squares,
    Stream,
    identity_collate,
    record_init,
)

FORK = "fork" in torch.multiprocessing.get_all_start_methods()
needs_fork = pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")


def _rows(loader: DataLoader) -> list[tuple[int, ...]]:
    """The SeedProbe items of one epoch, one tuple per sample."""
    return [tuple(int(v) for v in item) for batch in loader for item in zip(*batch, strict=True)]


# ------------------------------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("culprit", ["dataset", "collate_fn", "worker_init_fn"])
def test_fast_loader_names_the_unpicklable_object_before_any_worker(method: str, culprit: str) -> None:
    class LocalDataset(Dataset):  # a local class cannot be pickled
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return i

    kwargs: dict = {"collate_fn": identity_collate, "worker_init_fn": record_init}
    dataset: object = list(range(4))
    if culprit == "dataset":
        dataset = LocalDataset()
    else:
        kwargs[culprit] = lambda *a: a
    with pytest.raises(SpeedupsError, match=rf"fast_loader\({culprit}=.*'{method}'.*num_workers=0"):
        fast_loader(dataset, 2, num_workers=2, multiprocessing_context=method, **kwargs)


@needs_fork
def test_fork_does_not_pickle_so_a_lambda_collate_gets_workers() -> None:
    loader = fast_loader(
        list(range(8)), 2, num_workers=2, collate_fn=lambda b: b, multiprocessing_context="fork"
    )
    assert loader.num_workers == 2
    assert list(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_installed_worker_init_fn_pickles() -> None:
    plain = fast_loader(list(range(4)), 2, num_workers=0)
    wrapped = fast_loader(list(range(4)), 2, num_workers=0, worker_init_fn=record_init)
    assert plain.worker_init_fn is seed_worker
    assert isinstance(wrapped.worker_init_fn, functools.partial)
    for fn in (plain.worker_init_fn, wrapped.worker_init_fn):
        assert pickle.loads(pickle.dumps(fn)) is not None


# ------------------------------------------------------------------------------------------ worker seeding
@needs_fork
@pytest.mark.parametrize("persistent", [True, False])
def test_worker_streams_are_distinct_across_workers_and_epochs_and_reproducible(persistent: bool) -> None:
    def two_epochs(**kw: object) -> list[list[tuple[int, ...]]]:
        loader = fast_loader(
            SeedProbe(8),
            2,
            num_workers=2,
            multiprocessing_context="fork",
            persistent_workers=persistent,
            **kw,
        )
        return [_rows(loader), _rows(loader)]

    first = two_epochs(seed=123)
    assert first == two_epochs(seed=123)  # reproducible from the seed
    assert first == two_epochs(generator=torch.Generator().manual_seed(123))  # ... or the generator
    assert first != two_epochs(seed=124)
    draws = [(row[3], row[4]) for epoch in first for row in epoch]  # (numpy, random) of every item
    assert len(set(draws)) == len(draws)  # no two items, workers or epochs share a draw
    for epoch in first:
        assert {row[1] for row in epoch} == {0, 1}
    # Persistent workers keep their torch seed (and continue their streams) into the next epoch; others
    # get a new seed each epoch.
    seeds = [{r[2] for r in epoch} for epoch in first]
    if persistent:
        assert seeds[0] == seeds[1]
    else:
        assert seeds[0].isdisjoint(seeds[1])


def _rows_with_init(method: str, num_workers: int, seed: int, init: object) -> list[tuple[int, ...]]:
    kwargs = {} if init is None else {"worker_init_fn": init}
    loader = fast_loader(
        SeedProbe(4), 2, num_workers=num_workers, seed=seed, multiprocessing_context=method, **kwargs
    )
    return _rows(loader)


@needs_fork
def test_users_worker_init_fn_is_called_after_ours() -> None:
    """The user's init draws from the stream our seeding set up: its draw is what the first item would
    have drawn without it, and the first item then draws the stream's second number."""
    plain = _rows_with_init("fork", 2, 7, None)
    inited = _rows_with_init("fork", 2, 7, functools.partial(record_init, offset=500))
    for worker in (0, 1):
        draws = [r[3] for r in plain if r[1] == worker]
        mine = [r for r in inited if r[1] == worker]
        assert all(r[6] == (500 + worker) * 1000 + draws[0] % 1000 for r in mine)
        assert len(mine) == len(draws) == 2
        assert mine[0][3] == draws[1] != draws[0]


@pytest.mark.slow
def test_spawn_workers_run_the_seeding_and_the_users_init() -> None:
    plain = _rows_with_init("spawn", 1, 3, None)
    rows = _rows_with_init("spawn", 1, 3, record_init)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert rows[0][6] == 100 * 1000 + plain[0][3] % 1000  # the init ran, after our seeding
    assert [r[3] for r in rows[:3]] == [r[3] for r in plain[1:]]


# ------------------------------------------------------------------------------------- fast_loader defaults
def test_auto_workers_use_affinity_divided_by_local_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")  # a job of 16 processes; the node runs LOCAL_WORLD_SIZE of them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = fast_loader(list(range(16)), 4)
    assert loader.num_workers == 4
    assert loader.persistent_workers and loader.prefetch_factor == 2  # persisting exactly: see below
    assert loader.pin_memory is torch.cuda.is_available()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    loader = fast_loader(list(range(16)), 4, prefetch_factor=3, persistent_workers=True)
    assert loader.num_workers == 1 and loader.prefetch_factor == 3  # the user's value wins
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert fast_loader(list(range(16)), 4).num_workers == 6


def test_prefetch_keeps_four_batches_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fast_loader(list(range(4)), 2, num_workers=1).prefetch_factor == 4
    assert fast_loader(list(range(4)), 2, num_workers=2).prefetch_factor == 2
    assert fast_loader(list(range(4)), 2, num_workers=0).prefetch_factor is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # less than one CPU each: no workers, no worker settings
    loader = fast_loader(list(range(4)), 2, prefetch_factor=4, multiprocessing_context="spawn")
    assert loader.num_workers == 0 and loader.prefetch_factor is None


def test_auto_zero_workers_drops_worker_only_settings() -> None:
    with pytest.warns(SpeedupsWarning, match="IterableDataset"):
        loader = fast_loader(
            Stream(4), 2, prefetch_factor=4, persistent_workers=True, multiprocessing_context="spawn"
        )
    assert loader.num_workers == 0 and not loader.persistent_workers and loader.prefetch_factor is None


def test_pin_memory_only_when_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fast_loader(list(range(4)), 2, num_workers=0).pin_memory is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fast_loader(list(range(4)), 2, num_workers=0).pin_memory is False
    assert fast_loader(list(range(4)), 2, num_workers=0, pin_memory=True).pin_memory is True


def test_iterable_dataset_auto_gets_zero_workers_with_a_warning() -> None:
    with pytest.warns(SpeedupsWarning, match="IterableDataset gets 0 workers"):
        loader = fast_loader(Stream(5), 2)
    assert loader.num_workers == 0
    assert [b.tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0]]


def test_same_batches_as_a_plain_dataloader_with_the_same_generator() -> None:
    mine = fast_loader(Squares(10), 3, shuffle=True, num_workers=0, seed=11)
    plain = DataLoader(Squares(10), 3, shuffle=True, generator=torch.Generator().manual_seed(11))
    for a, b in zip(list(mine) + list(mine), list(plain) + list(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch_size": 0}, ValueError, r"fast_loader\(batch_size=0.*>= 1"),
        ({"batch_size": 2.5}, TypeError, r"batch_size=2\.5: expected an int"),
        ({"batch_size": 2, "num_workers": -1}, ValueError, r"num_workers=-1.*>= 0"),
        ({"batch_size": 2, "num_workers": "many"}, TypeError, r"num_workers='many': expected an int.*'auto'"),
        ({"batch_size": 2, "seed": 1, "generator": torch.Generator()}, ValueError, "both seed and generator"),
        ({"batch_size": 2, "shuffle": "yes"}, TypeError, "shuffle='yes': expected True or False"),
        ({"batch_size": 2, "workers": 2}, TypeError, r"unknown DataLoader argument\(s\) \['workers'\]"),
    ],
)
def test_fast_loader_bad_input(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fast_loader(list(range(4)), **kwargs)


@pytest.mark.parametrize("dataset", [None, 5, "abc"])
def test_fast_loader_rejects_what_is_not_a_dataset(dataset) -> None:
    with pytest.raises(TypeError, match=r"fast_loader\(dataset="):
        fast_loader(dataset, 4)


def test_fast_loader_checks_its_worker_init_fn() -> None:
    with pytest.raises(TypeError, match=r"worker_init_fn=5: expected a function of the worker id.*Write"):
        fast_loader(list(range(4)), 2, worker_init_fn=5)


def _two_ids(worker_id: int, other: int) -> None:
    pass


def _no_id() -> None:
    pass


def _keyword_id(*, worker_id: int) -> None:
    pass


class _Init:
    def __call__(self, worker_id: int) -> None:
        pass


@pytest.mark.parametrize(
    ("init", "match"),
    [
        (
            _two_ids,
            r"_two_ids at .*\(worker_id, other\).*missing a required argument: 'other'.*def _two_ids\(",
        ),
        (_no_id, r"\(\) cannot take that \(too many positional arguments\)"),
        (_keyword_id, r"\(\*, worker_id\)"),
        (lambda a, b: None, r"<lambda>.*\(a, b\).*def init\(worker_id\).*functools\.partial\(init, \.\.\.\)"),
    ],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_init_fn_that_cannot_take_the_worker_id_is_refused_at_once(init, match, workers) -> None:
    """torch calls it only inside a worker, at the first batch ('Caught TypeError in DataLoader worker')."""
    with pytest.raises(
        TypeError, match=r"fast_loader\(batch_size=2, num_workers=\d.*: worker_init_fn=.*" + match
    ):
        fast_loader(list(range(4)), 2, num_workers=workers, worker_init_fn=init)


@pytest.mark.parametrize(
    "init", [record_init, functools.partial(_two_ids, other=1), _Init(), lambda *ids: None, print]
)
def test_a_worker_init_fn_of_the_worker_id_is_accepted(init) -> None:
    assert fast_loader(list(range(4)), 2, num_workers=0, worker_init_fn=init).worker_init_fn is not None


def _generated():
    yield from range(4)


class _IndexedOnly:
    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (
            torch.nn.Sequential(torch.nn.Linear(2, 2)),
            r"Sequential\(\.\.\.\), 4\): dataset is a model.*TensorDataset\(x, y\), 4\)",
        ),
        (torch.nn.Linear(2, 2), r"Linear\(\.\.\.\), 4\): dataset is a model"),
        (
            torch.zeros(10, 3),
            r"tensor of shape \(10, 3\), 4\): a bare tensor.*fast_loader\(TensorDataset\(x, y\), 4\)",
        ),
        (Squares, r"Squares, 4\): dataset is a class.*fast_loader\(Squares\(\.\.\.\), 4\)"),
        (
            (torch.zeros(8, 2), torch.zeros(8)),  # a new user's (x, y): 2 samples, one per tensor
            r"a tuple of tensors of shapes \(8, 2\), \(8,\), 4\).*TensorDataset\(\*tensors\), 4\)",
        ),
        (_generated(), r"got generator\. A plain iterable.*IterableDataset"),
        (_IndexedOnly(), r"has __getitem__ but no __len__.*sampler="),
    ],
)
def test_what_dataloader_would_fail_on_at_the_first_batch_is_refused_at_once(dataset, match) -> None:
    with pytest.raises(TypeError, match=r"fast_loader\(dataset=.*" + match):
        fast_loader(dataset, 4, num_workers=0)


def test_a_tuple_of_sample_vectors_is_still_a_dataset_of_them() -> None:
    loader = fast_loader((torch.ones(3), torch.zeros(3)), 1, num_workers=0)  # two samples of shape (3,)
    assert [b.tolist() for b in loader] == [[[1.0, 1.0, 1.0]], [[0.0, 0.0, 0.0]]]


def test_an_indexed_dataset_without_len_is_accepted_with_a_sampler() -> None:
    loader = fast_loader(_IndexedOnly(), 2, num_workers=0, sampler=[3, 1, 2])
    assert [b.tolist() for b in loader] == [[3, 1], [2]]


def test_a_module_that_is_also_a_dataset_is_accepted() -> None:
    class Both(torch.nn.Module, Dataset):
        def __getitem__(self, index: int) -> int:
            return index

        def __len__(self) -> int:
            return 3

    assert [b.tolist() for b in fast_loader(Both(), 3, num_workers=0)] == [[0, 1, 2]]


# ------------------------------------------------------------------------------------ per-epoch dataset state
def _epochs_seen(loader: DataLoader, dataset: EpochItems, epochs: int = 3) -> list[list[list[int]]]:
    seen = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        seen.append(sorted(row.tolist() for batch in loader for row in batch))
    return seen


@needs_fork
def test_set_epoch_state_reaches_the_workers_as_with_a_plain_dataloader() -> None:
    ds = EpochItems(8)
    plain = _epochs_seen(DataLoader(ds, 4, num_workers=2, multiprocessing_context="fork"), ds)
    assert [sorted({e for _, e in epoch}) for epoch in plain] == [[0], [1], [2]]  # the reference's view
    loader = fast_loader(ds, 4, num_workers=2, multiprocessing_context="fork")
    assert loader.persistent_workers is False
    assert _epochs_seen(loader, ds) == plain


def test_persistent_workers_stay_off_for_datasets_wrapping_one_with_set_epoch() -> None:
    ds = EpochItems(8)
    for wrapped in (ds, Subset(ds, [0, 1, 2]), ConcatDataset([Squares(4), Subset(ds, [1])])):
        assert fast_loader(wrapped, 2, num_workers=2).persistent_workers is False
    assert fast_loader(Squares(4), 2, num_workers=2, sample_seeds=True).persistent_workers is True
    for wrapped in (ds, Subset(ds, [0, 1, 2])):  # per-sample seeds do not bring per-epoch state to workers
        assert fast_loader(wrapped, 2, num_workers=2, sample_seeds=True).persistent_workers is False
    # An explicit choice wins, as with DataLoader itself (whose persistent workers behave the same).
    assert fast_loader(ds, 2, num_workers=2, persistent_workers=True).persistent_workers is True


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_a_stream_read_by_several_ranks_or_workers_is_warned_about_both(monkeypatch) -> None:
    with pytest.warns(SpeedupsWarning, match=r"each of the 2 workers would read the whole stream"):
        fast_loader(_Stream(), 4, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast_loader(_Stream(), 4, num_workers=0)  # one reader: nothing to say
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for workers in (0, "auto"):
        with pytest.warns(
            SpeedupsWarning, match=r"each of the 2 ranks would read the whole stream.*distributed"
        ):
            fast_loader(_Stream(), 4, num_workers=workers)


def test_a_dataloader_passed_as_dataset_is_refused_with_its_dataset_as_the_fix() -> None:
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=4)
    with pytest.raises(TypeError, match=r"dataset is already a DataLoader.*fast_loader\(loader.dataset, 64"):
        fast_loader(loader, 64)


def test_a_leftover_local_world_size_outside_a_job_is_ignored_and_named(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.warns(SpeedupsWarning, match=r"LOCAL_WORLD_SIZE=8 but the job has 1 process"):
        loader = fast_loader(list(range(8)), 2)
    assert loader.num_workers == 4  # this process's CPUs, not 4 // 8 = 0


# ---------------------------------------------- draw order: the DataLoader it replaces, epoch after epoch
def _epochs_and_draws(make, epochs: int = 3) -> list[torch.Tensor]:
    """Each epoch's batches (indices and augmentation draws), then the main process's next torch, random
    and numpy draws (as a loop's own noise), from seed 0 in all three."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    loader = make()
    seen = []
    for _ in range(epochs):
        seen.append(torch.cat(list(loader)))
        seen.append(torch.cat([torch.rand(3, dtype=torch.float64), torch.tensor([random.random()])]))
        seen.append(torch.tensor([np.random.rand()]))
    return seen


@needs_fork
@pytest.mark.parametrize("generator", [False, True], ids=["global RNG", "generator="])
@pytest.mark.parametrize(
    "workers",
    [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}],
    ids=["0 workers", "2 workers", "2 persistent workers (asked)"],
)
def test_batches_and_the_main_processs_draws_are_the_plain_dataloaders_epoch_after_epoch(
    workers: dict, generator: bool
) -> None:
    """What a port to fast_loader keeps: every batch, with random augmentation drawn in the workers from
    torch, random and numpy, and every later draw of the main process (the next epoch's shuffle, the
    loop's own noise), bit for bit, over 3 epochs. (Persistent workers, fast_loader's default before, draw
    the workers' base seed once: from epoch 2 on both differed.)"""
    data = Augmented(12)

    def kw() -> dict:
        extra = {"multiprocessing_context": "fork"} if workers["num_workers"] else {}
        return workers | extra | ({"generator": torch.Generator().manual_seed(5)} if generator else {})

    plain = _epochs_and_draws(lambda: DataLoader(data, 4, shuffle=True, **kw()))
    fast = _epochs_and_draws(lambda: fast_loader(data, 4, shuffle=True, **kw()))
    for i, (want, got) in enumerate(zip(plain, fast, strict=True)):
        assert torch.equal(want, got), f"epoch {i // 3 + 1}, {['batches', 'main draws', 'numpy'][i % 3]}"
    assert not torch.equal(plain[0], plain[3])  # the epochs differ: the comparison has teeth


def test_workers_persist_by_default() -> None:
    """Workers persist; they draw what fresh ones draw (tests/data/test_exact_persistence.py)."""
    mine = torch.Generator().manual_seed(1)
    assert fast_loader(Squares(4), 2, num_workers=2).persistent_workers is True
    assert fast_loader(Squares(4), 2, num_workers=2, seed=3).persistent_workers is True
    assert fast_loader(Squares(4), 2, num_workers=2, sample_seeds=True).persistent_workers is True
    assert fast_loader(Squares(4), 2, num_workers=2, sample_seeds=True, seed=3).persistent_workers is True
    # a generator of the user's feeds the workers' base seeds: drawn every epoch, as DataLoader does
    assert (
        fast_loader(Squares(4), 2, num_workers=2, sample_seeds=True, generator=mine).persistent_workers
        is True
    )
    assert fast_loader(Squares(4), 2, num_workers=2, persistent_workers=True).persistent_workers is True
    assert fast_loader(Squares(4), 2, num_workers=2, persistent_workers=False).persistent_workers is False

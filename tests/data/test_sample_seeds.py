"""Per-sample random streams (``sample_seeds=True``): the same augmented batches whatever the workers.

The reference is computed by hand in each test: the order is torch's ``DistributedSampler`` (seed + epoch),
and sample i of epoch e is the dataset's item loaded after seeding torch, ``random`` and numpy from
``sample_seed(seed, e, i)`` as the docstrings say. The resume matrix row (a fresh process, 2 workers) is
in tests/checkpoint/test_resume.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, Subset

from speedups import distributed, fast_loader, tune_loader
from speedups._helpers.rng import sample_seed
from tests._dist import WORKERS, run_torchrun
from tests._loading_data import Augmented, AugmentedImages, LateDraws, Stream

SEED, N, BATCH = 5, 24, 4


def _by_hand(dataset, seed: int, epoch: int, index: int):
    """Item ``index`` of ``epoch`` as documented: torch, random and numpy seeded from sample_seed(...)."""
    z = sample_seed(seed, epoch, index)
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(z)
    random.seed(z)
    np.random.seed(z >> 32)
    try:
        return dataset[index]
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def _order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _expected_epoch(dataset, seed: int, epoch: int) -> torch.Tensor:
    return torch.stack([_by_hand(dataset, seed, epoch, i) for i in _order(len(dataset), seed, epoch)])


def _epochs(loader, epochs: int = 2) -> list[torch.Tensor]:
    return [torch.cat(list(loader)) for _ in range(epochs)]


LAYOUTS = [
    pytest.param({"num_workers": 0}, id="0 workers"),
    pytest.param({"num_workers": 1}, id="1 persistent worker"),
    pytest.param({"num_workers": 2}, id="2 persistent workers"),
    pytest.param({"num_workers": 2, "persistent_workers": False}, id="2 workers"),
    pytest.param({"num_workers": 2, "prefetch_factor": 1}, id="2 workers, prefetch 1"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_worker_layout_yields_the_hand_computed_augmented_batches_for_two_epochs(layout) -> None:
    data = Augmented(N)
    got = _epochs(fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, **layout))
    for epoch in range(2):
        assert torch.equal(got[epoch], _expected_epoch(data, SEED, epoch)), f"epoch {epoch}"
    assert not torch.equal(got[0][:, 1:], got[1][:, 1:])  # each epoch draws anew
    # Without sample_seeds the worker count changes the augmentation: the case this mode exists for.
    plain = [torch.cat(list(fast_loader(data, BATCH, seed=SEED, num_workers=w))) for w in (0, 2)]
    assert torch.equal(plain[0][:, 0], plain[1][:, 0]) and not torch.equal(plain[0], plain[1])


def test_torchvision_v2_transforms_follow_the_sample_seeds() -> None:
    data = AugmentedImages(12)
    got = [fast_loader(data, 3, shuffle=True, seed=1, sample_seeds=True, num_workers=w) for w in (0, 2)]
    for epoch, (a, b) in enumerate(zip(*(_epochs_pairs(loader) for loader in got), strict=True)):
        expected = [_by_hand(data, 1, epoch, i) for i in _order(12, 1, epoch)]
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], torch.stack([x for x, _ in expected]))
        assert a[1].tolist() == b[1].tolist() == [i for _, i in expected]


def _epochs_pairs(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(2):
        batches = list(loader)
        out.append((torch.cat([x for x, _ in batches]), torch.cat([i for _, i in batches])))
    return out


def test_the_processs_own_streams_are_left_where_they_were() -> None:
    """0 workers: loading draws nothing from the main process's torch, random and numpy streams."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    untouched = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    loader = fast_loader(Augmented(N), BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=0)
    for _ in loader:
        pass
    after = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(after[0], untouched[0]) and after[1:] == untouched[1:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_drawn_from_by_some_items_only_is_seeded_for_them(workers: int) -> None:
    data = LateDraws(24, late=12)  # items 12-23 also draw from `random`
    loader = fast_loader(data, 4, seed=SEED, sample_seeds=True, num_workers=workers)
    for epoch in range(2):
        expected = torch.stack([_by_hand(data, SEED, epoch, i) for i in range(24)])
        assert torch.equal(torch.cat(list(loader)), expected)


@pytest.mark.parametrize(
    "layout",
    [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": False}],
    ids=["0 workers", "2 persistent workers", "2 workers"],
)
def test_without_a_seed_loading_draws_nothing_from_the_main_processs_streams(layout) -> None:
    """torch's DataLoader draws its workers' base seed from the global RNG each pass (once, with persistent
    workers): under sample_seeds it draws from a generator of its own, so training's draws (dropout) do
    not depend on the layout."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    untouched = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    loader = fast_loader(Augmented(8), 4, shuffle=True, sample_seeds=True, **layout)
    for _ in range(3):
        list(loader)
    after = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(after[0], untouched[0]) and after[1:] == untouched[1:]


def test_the_order_is_distributed_samplers_and_set_epoch_moves_it() -> None:
    data = Augmented(N)
    loader = fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=0)
    loader.sampler.set_epoch(3)  # e.g. resuming at an epoch boundary
    assert torch.equal(torch.cat(list(loader)), _expected_epoch(data, SEED, 3))
    unshuffled = fast_loader(data, BATCH, seed=SEED, sample_seeds=True, num_workers=0)
    assert [int(r[0]) for r in torch.cat(list(unshuffled))] == list(range(N))
    # Without seed: torch.initial_seed(), read when the loader is built.
    torch.manual_seed(11)
    implicit = fast_loader(data, BATCH, shuffle=True, sample_seeds=True, num_workers=0)
    assert torch.equal(torch.cat(list(implicit)), _expected_epoch(data, 11, 0))
    own = fast_loader(
        data, BATCH, sample_seeds=True, generator=torch.Generator().manual_seed(7), num_workers=0
    )
    assert torch.equal(
        torch.cat(list(own))[:, 1:], torch.stack([_by_hand(data, 7, 0, i) for i in range(N)])[:, 1:]
    )


def test_a_users_sampler_and_batch_sampler_are_kept() -> None:
    data = Augmented(N)
    g = torch.Generator().manual_seed(2)
    mine = RandomSampler(data, generator=g)
    order = [list(mine) for _ in range(2)]  # what the sampler yields in its first two passes
    g.manual_seed(2)
    loader = fast_loader(data, BATCH, sampler=mine, seed=SEED, sample_seeds=True, num_workers=2)
    for epoch, got in enumerate(_epochs(loader)):
        assert torch.equal(got, torch.stack([_by_hand(data, SEED, epoch, i) for i in order[epoch]]))
    # A DistributedSampler's epoch is its own (set_epoch on loader.sampler reaches it).
    split = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = fast_loader(data, BATCH, sampler=split, seed=SEED, sample_seeds=True, num_workers=0)
    loader.sampler.set_epoch(4)
    assert split.epoch == 4
    assert torch.equal(
        torch.cat(list(loader)), torch.stack([_by_hand(data, SEED, 4, i) for i in list(split)])
    )
    batches = BatchSampler(range(N), batch_size=5, drop_last=True)
    loader = fast_loader(
        data, batch_size=1, batch_sampler=batches, seed=SEED, sample_seeds=True, num_workers=0
    )
    got = _epochs(loader)
    assert [len(b) for b in loader] == [5] * 4
    for epoch in range(2):
        assert torch.equal(got[epoch], torch.stack([_by_hand(data, SEED, epoch, i) for i in range(20)]))


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("persistent", [True, False])
def test_without_automatic_batching_or_with_a_batch_sampler_each_pass_is_one_epoch(
    workers, persistent
) -> None:
    """torch's multi-worker iterator calls iter() on the index sampler twice in its first pass."""
    data = Augmented(8)
    kw = {"num_workers": workers} | ({"persistent_workers": persistent} if workers else {})
    single = fast_loader(data, None, seed=SEED, sample_seeds=True, **kw)
    batched = fast_loader(
        data, 1, batch_sampler=[[0, 1, 2], [3, 4, 5, 6, 7]], seed=SEED, sample_seeds=True, **kw
    )
    for epoch in range(2):
        expected = torch.stack([_by_hand(data, SEED, epoch, i) for i in range(8)])
        assert torch.equal(torch.stack(list(single)), expected)
        assert torch.equal(torch.cat(list(batched)), expected)
    assert single.sampler.next_epoch == batched.batch_sampler.next_epoch == 2


def test_the_dataset_is_wrapped_but_reads_through() -> None:
    data = Augmented(N)
    loader = fast_loader(data, BATCH, sample_seeds=True, num_workers=0)
    assert (
        loader.dataset.classes == ["a", "b"] and len(loader.dataset) == N and loader.dataset.dataset is data
    )
    again = fast_loader(loader.dataset, BATCH, num_workers=0)  # another loader of the same data, unseeded
    assert again.dataset is data
    loader.dataset.classes = ["c"]  # per-epoch state set through the loader reaches the user's dataset
    assert data.classes == ["c"] and loader.dataset.classes == ["c"]
    data.seed = 100  # a dataset's own `seed` attribute is its own
    loader.dataset.seed = 200
    assert data.seed == loader.dataset.seed == 200 and loader.dataset.samples_seed != 200
    del loader.dataset.seed
    assert not hasattr(data, "seed")
    # A plain index loads the user's item, unseeded, as the dataset itself would.
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    direct = loader.dataset[5]
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert torch.equal(direct, data[5])


def test_a_seeded_dataset_wrapped_again_is_seeded_by_the_outer_loader() -> None:
    first = fast_loader(Augmented(N), BATCH, seed=SEED, sample_seeds=True, num_workers=0)
    subset = Subset(first.dataset, [0, 1, 2, 3])
    loader = fast_loader(subset, 2, seed=1, sample_seeds=True, num_workers=0)
    epochs = _epochs(loader)
    for epoch in range(2):
        assert torch.equal(epochs[epoch], torch.stack([_by_hand(subset, 1, epoch, i) for i in range(4)]))
    assert not torch.equal(epochs[0], epochs[1])


# -------------------------------------------------------------------------------------------- distributed
def _by_index(loaders, epochs: int = 2) -> list[dict[int, torch.Tensor]]:
    out: list[dict[int, torch.Tensor]] = [{} for _ in range(epochs)]
    for epoch in range(epochs):
        for loader in loaders:
            for row in torch.cat(list(loader)):
                out[epoch][int(row[0])] = row
    return out


def test_two_ranks_yield_the_samples_of_one_process_for_the_same_global_order() -> None:
    data = Augmented(N)
    one = _by_index([distributed(DataLoader(data, BATCH, shuffle=True), seed=SEED, sample_seeds=True,
                                 rank=0, world_size=1)])  # fmt: skip
    two = _by_index(
        [
            distributed(fast_loader(data, 2, shuffle=True, num_workers=w), seed=SEED, sample_seeds=True,
                        rank=r, world_size=2)
            for r, w in ((0, 0), (1, 2))
        ]
    )  # fmt: skip
    for epoch in range(2):
        assert sorted(two[epoch]) == list(range(N))
        for i in range(N):
            assert torch.equal(two[epoch][i], one[epoch][i])
            assert torch.equal(one[epoch][i], _by_hand(data, SEED, epoch, i))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_torchrun_job_of_two_ranks_yields_the_samples_of_one_process(tmp_path: Path) -> None:
    done = run_torchrun(WORKERS / "sample_seeds_ranks.py", [str(tmp_path)], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"samples-rank{r}.pt", weights_only=True) for r in (0, 1)]
    data = Augmented(N)
    for epoch in range(2):
        expected = _expected_epoch(data, SEED, epoch)  # one process, the same global order
        assert torch.equal(ranks[0][epoch], expected[0::2]) and torch.equal(ranks[1][epoch], expected[1::2])


def test_without_a_seed_every_rank_uses_distributeds_seed() -> None:
    """fast_loader's seed would come from torch.initial_seed(), which fresh processes do not share."""
    data = Augmented(10)
    ranks = []
    for rank in (0, 1):
        torch.manual_seed(100 + rank)  # each rank's own global seed, as fresh processes have
        loader = fast_loader(data, 5, shuffle=True, sample_seeds=True, num_workers=0)
        ranks.append(distributed(loader, rank=rank, world_size=2))
    got = [torch.cat(list(r)) for r in ranks]
    expected = _expected_epoch(data, 0, 0)  # distributed's seed=0, as for any loader
    assert torch.equal(got[0], expected[0::2]) and torch.equal(got[1], expected[1::2])


def test_distributed_keeps_fast_loaders_seeds_and_order() -> None:
    data = Augmented(N)
    plain = fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=0)
    one_rank = distributed(plain, rank=0, world_size=1)  # sample_seeds=None keeps them, and their seed
    assert torch.equal(torch.cat(list(one_rank)), _expected_epoch(data, SEED, 0))
    with pytest.raises(ValueError, match=r"seed=6 contradicts it.*pass seed=5"):
        distributed(plain, seed=6, rank=0, world_size=1)
    off = distributed(plain, sample_seeds=False, rank=0, world_size=1)
    assert off.dataset is data


def test_a_mid_epoch_resume_with_fresh_workers_yields_the_same_batches() -> None:
    def build(workers: int):
        return distributed(fast_loader(Augmented(N), 2, shuffle=True, seed=SEED, sample_seeds=True,
                                       num_workers=workers), rank=1, world_size=2)  # fmt: skip

    ref = build(2)
    whole = [list(ref) for _ in range(3)]
    stopped = build(2)
    list(stopped)
    it = iter(stopped)
    next(it), next(it)
    state = stopped.state_dict()  # 2 batches into epoch 1
    del it
    resumed = build(0)  # a fresh loader in another layout: 0 workers
    resumed.load_state_dict(state)
    got = [list(resumed) for _ in range(2)]
    assert torch.equal(torch.cat(got[0]), torch.cat(whole[1][2:]))
    assert torch.equal(torch.cat(got[1]), torch.cat(whole[2]))


# ---------------------------------------------------------------------------------------------- tuning
def test_tune_loader_keeps_the_augmentation_and_the_epoch_count() -> None:
    data = Augmented(N)
    loader = fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=0)
    tuned, report = tune_loader(loader, max_seconds=2, candidates=[{"num_workers": 0}, {"num_workers": 2}],
                                progress=False)  # fmt: skip
    assert report.trials
    assert torch.equal(torch.cat(list(tuned)), _expected_epoch(data, SEED, 0))
    # A batch sampler of the user's, with a generator inside: timing reads it once and puts it back.
    shuffled = BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(0)), 4, False)
    mine = fast_loader(data, 1, batch_sampler=shuffled, seed=SEED, sample_seeds=True, num_workers=0)
    tuned, _ = tune_loader(mine, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    got = torch.cat(list(tuned))
    shuffled.sampler.generator.manual_seed(0)
    order = [i for batch in shuffled for i in batch]  # the sampler's first pass
    assert torch.equal(got, torch.stack([_by_hand(data, SEED, 0, i) for i in order]))
    batches = BatchSampler(range(N), batch_size=4, drop_last=False)
    custom = fast_loader(
        data, batch_size=1, batch_sampler=batches, seed=SEED, sample_seeds=True, num_workers=0
    )
    tuned, _ = tune_loader(custom, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    assert torch.equal(torch.cat(list(tuned)), torch.stack([_by_hand(data, SEED, 0, i) for i in range(N)]))


@pytest.mark.slow
def test_tune_loader_may_drop_persistent_workers_of_a_seeded_order_and_keeps_them_when_adding_workers() -> (
    None
):
    data = Augmented(N)
    persistent = fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=2)
    tuned, report = tune_loader(persistent, max_seconds=1, candidates=[{"num_workers": 0}], progress=False)
    assert tuned.num_workers == 0 and "not timed" not in report.reason
    none = fast_loader(data, BATCH, shuffle=True, seed=SEED, sample_seeds=True, num_workers=0)
    tuned, report = tune_loader(none, max_seconds=1, candidates=[{"num_workers": 2}], progress=False)
    assert tuned.num_workers == 2 and tuned.persistent_workers and report.chosen["persistent_workers"]
    for epoch in range(2):  # whatever was chosen, the same batches
        assert torch.equal(torch.cat(list(tuned)), _expected_epoch(data, SEED, epoch))


class _NoLength(Dataset):
    def __getitem__(self, i: int) -> int:
        return i


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_before_anything_is_built() -> None:
    with pytest.raises(TypeError, match=r"sample_seeds='yes': expected True or False"):
        fast_loader(Augmented(), 4, sample_seeds="yes")
    with pytest.raises(ValueError, match=r"sample_seeds=True needs a map-style dataset.*Stream"):
        fast_loader(Stream(8), 4, sample_seeds=True, num_workers=0)
    with pytest.raises(ValueError, match=r"sample_seeds=True needs a map-style dataset"):
        distributed(DataLoader(Stream(8), 4), sample_seeds=True, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"sample_seeds=1"):
        distributed(DataLoader(Augmented(), 4), sample_seeds=1, rank=0, world_size=1)
    words = fast_loader({"a": 1.0, "b": 2.0}, 1, sampler=["a", "b"], sample_seeds=True, num_workers=0)
    with pytest.raises(TypeError, match=r"index 'a' \(str\); per-sample seeds need integer indices"):
        list(words)
    loader = fast_loader(Augmented(), 4, sample_seeds=True, num_workers=0)
    for bad, error in ((-1, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"set_epoch\(epoch=.*\): epoch="):
            loader.sampler.set_epoch(bad)
    assert loader.sampler.next_epoch == 0  # unchanged
    for seed in (-1, 2**63):
        with pytest.raises(ValueError, match=r"seed=.*: must be an int >= 0 and <= 9223372036854775807"):
            fast_loader(Augmented(), 4, seed=seed, sample_seeds=True, num_workers=0)
        with pytest.raises(ValueError, match=r"seed=.*: must be an int >= "):
            distributed(DataLoader(Augmented(), 4), seed=seed, sample_seeds=True, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"seed=18446744073709551616: must be an int"):
        fast_loader(Augmented(), 4, seed=2**64, num_workers=0)
    with pytest.raises(ValueError, match=r"epoch=9223372036854775808: must be"):
        loader.sampler.set_epoch(2**63)
    with pytest.raises(TypeError, match=r"_NoLength has __getitem__ but no __len__.*a __len__"):
        fast_loader(_NoLength(), 2, sample_seeds=True, num_workers=0)
    with pytest.raises(TypeError, match=r"sample_seeds=np.True_: expected True or False, got numpy.bool"):
        fast_loader(Augmented(), 4, sample_seeds=np.True_)

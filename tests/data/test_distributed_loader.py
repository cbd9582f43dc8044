"""Tip 9's data half in one process: distributed(loader) splits, advances, pads or not, and resumes.

Multi-process runs (real torchrun jobs) are in tests/test_distributed_jobs.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler

from speedups import DistributedLoader, SpeedupsError, distributed, fast_loader
from tests._loading_data import Augmented


def _flat(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


# --------------------------------------------------------------------------------------------- A3: sampler
def test_epochs_differ_ranks_disjoint_cover_all_agree_and_resume() -> None:
    base = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    ranks = [distributed(base, rank=r, world_size=2) for r in (0, 1)]
    epochs = [[_flat(loader) for loader in ranks] for _ in range(2)]  # two passes, no set_epoch by hand
    for e in range(2):
        r0, r1 = epochs[e]
        assert len(r0) == len(r1) == 10 and not set(r0) & set(r1) and sorted(r0 + r1) == list(range(20))
    assert epochs[0][0] != epochs[1][0]
    # Both ranks agree on the permutation: it is torch's DistributedSampler with seed + epoch.
    for e in range(2):
        for r in (0, 1):
            ref = DistributedSampler(list(range(20)), num_replicas=2, rank=r, shuffle=True, seed=0)
            ref.set_epoch(e)
            assert epochs[e][r] == list(ref)
    # Resuming at epoch 1 replays epoch 1 exactly, on a fresh loader (set_epoch and state dict).
    fresh = distributed(base, rank=1, world_size=2)
    fresh.set_epoch(1)
    assert _flat(fresh) == epochs[1][1]
    again = distributed(base, rank=0, world_size=2)
    again.load_state_dict({"epoch": 1, "batches": 0, "world_size": 2, "rank": 0})
    assert _flat(again) == epochs[1][0] and again.epoch == 1


def _position(state: dict) -> dict:
    return {k: state[k] for k in ("epoch", "batches", "world_size", "rank")}


def test_mid_epoch_state_resumes_without_replay_or_skip() -> None:
    base = DataLoader(list(range(22)), batch_size=3, shuffle=True, drop_last=False)
    full = distributed(base, rank=1, world_size=2)
    _flat(full)  # epoch 0
    it = iter(full)  # epoch 1
    first = [next(it).tolist() for _ in range(2)]
    state = full.state_dict()
    assert _position(state) == {"epoch": 1, "batches": 2, "world_size": 2, "rank": 1}
    # Mid-pass: the RNG state the pass drew its base seed from (the resumed pass redraws it from there).
    assert state["seed_state"].dtype == torch.uint8 and state["generator"] is None
    rest = [b.tolist() for b in it]
    after = full.state_dict()
    assert _position(after) == {"epoch": 2, "batches": 0, "world_size": 2, "rank": 1}
    assert after["seed_state"] is None  # an epoch boundary: the next pass draws afresh, as uninterrupted
    resumed = distributed(base, rank=1, world_size=2)
    resumed.load_state_dict(state)
    again = resumed.state_dict()
    assert _position(again) == _position(state) and torch.equal(again["seed_state"], state["seed_state"])
    assert len(resumed) == len(rest)
    assert [b.tolist() for b in resumed] == rest and first + rest != rest
    # The resumed pass over, len() is a whole epoch's again (what an epoch() pass after it counts on).
    assert len(resumed) == len(full) == 4 and len(_flat(resumed)) == 11
    other = distributed(base, rank=1, world_size=4)
    with pytest.raises(ValueError, match="world size 2, loaded with 4"):
        other.load_state_dict(state)


def test_even_false_gives_every_sample_exactly_once_without_padding() -> None:
    base = DataLoader(list(range(11)), batch_size=2, shuffle=True)
    padded = [_flat(distributed(base, rank=r, world_size=3)) for r in range(3)]
    assert sum(map(len, padded)) == 12  # even=True pads like DistributedSampler
    exact = [_flat(distributed(base, rank=r, world_size=3, even=False)) for r in range(3)]
    assert sorted(exact[0] + exact[1] + exact[2]) == list(range(11)) and [len(e) for e in exact] == [4, 4, 3]
    loaders = [distributed(base, rank=r, world_size=3, even=False) for r in range(3)]
    assert [len(loader) for loader in loaders] == [2, 2, 2]


def test_loader_settings_are_kept_and_the_original_untouched() -> None:
    def collate(batch):
        return torch.tensor(batch) * 10

    g = torch.Generator().manual_seed(5)
    base = DataLoader(list(range(9)), batch_size=2, shuffle=True, drop_last=True, collate_fn=collate,
                      generator=g, pin_memory=False)  # fmt: skip
    before = base.sampler
    dl = distributed(base, rank=0, world_size=2)
    assert isinstance(dl, DataLoader) and isinstance(dl, DistributedLoader)
    assert (dl.batch_size, dl.drop_last, dl.collate_fn, dl.generator, dl.pin_memory) == (
        2,
        True,
        collate,
        g,
        False,
    )
    assert isinstance(dl.sampler, DistributedSampler) and dl.sampler.rank == 0
    assert len(dl) == 2 and all(int(v) % 10 == 0 for v in _flat(dl))  # 5 samples, drop_last: 2 batches
    assert base.sampler is before and isinstance(base.sampler, RandomSampler)
    # The original's sampler inside a user BatchSampler: rebuilt around the DistributedSampler.
    user = DataLoader(list(range(10)), batch_sampler=BatchSampler(RandomSampler(range(10)), 3, False))
    dl2 = distributed(user, rank=1, world_size=2)
    assert isinstance(dl2.batch_sampler, BatchSampler) and dl2.batch_sampler.batch_size == 3
    assert isinstance(dl2.distributed_sampler, DistributedSampler) and dl2.distributed_sampler.shuffle
    assert [len(b) for b in dl2] == [3, 2]
    # shuffle=None keeps the original's choice; explicit shuffle overrides it.
    seq = DataLoader(list(range(8)), batch_size=2)
    assert _flat(distributed(seq, rank=0, world_size=2)) == [0, 2, 4, 6]
    assert distributed(seq, rank=0, world_size=2, shuffle=True).distributed_sampler.shuffle


def test_loader_with_workers_still_works() -> None:
    base = DataLoader(list(range(8)), batch_size=2, shuffle=True, num_workers=1, persistent_workers=True)
    dl = distributed(base, rank=0, world_size=2)
    assert dl.num_workers == 1 and dl.persistent_workers
    epochs = [_flat(dl), _flat(dl)]
    assert epochs[0] != epochs[1] or len(set(epochs[0])) == 4


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: distributed([1, 2, 3]), TypeError, r"distributed\(loader=list\): expected a torch"),
        (lambda: distributed(DataLoader(range(4), sampler=[0, 1])), TypeError, "sampler is a list"),
        (lambda: distributed(DataLoader(range(4), shuffle=True), rank=2, world_size=2), ValueError, "rank"),
        (lambda: distributed(DataLoader(range(4)), world_size=0), ValueError, "world_size=0"),
        (lambda: distributed(DataLoader(range(4)), even="no"), TypeError, "even='no'"),
        (lambda: distributed(distributed(DataLoader(range(4)))), ValueError, "already distributed"),
        (lambda: distributed(DataLoader(range(4), sampler=RandomSampler(range(4), replacement=True))),
         TypeError, "replacement"),
    ],
)  # fmt: skip
def test_distributed_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


def _two_ids(worker_id: int, other: int) -> None:
    pass


def test_a_loaders_worker_init_fn_its_workers_cannot_call_is_refused_at_once() -> None:
    """A plain DataLoader never checks it; its workers would raise at the first batch of every rank."""
    with_workers = DataLoader(range(8), batch_size=2, num_workers=2, worker_init_fn=_two_ids)
    with pytest.raises(
        TypeError,
        match=r"distributed\(shuffle=None, .*\): loader\.worker_init_fn=<function _two_ids"
        r".*\(worker_id, other\).*functools\.partial\(_two_ids, \.\.\.\)",
    ):
        distributed(with_workers, rank=0, world_size=2)
    without = DataLoader(range(8), batch_size=2, worker_init_fn=_two_ids)  # never called, as in torch
    assert [b.tolist() for b in distributed(without, rank=0, world_size=2)] == [[0, 2], [4, 6]]


@pytest.mark.parametrize("bad", [{"batches": -2}, {"batches": 1.7}, {"epoch": -3}, {"batches": 10**6}])
def test_loader_load_state_dict_rejects_impossible_positions(bad) -> None:
    loader = distributed(DataLoader(list(range(10)), batch_size=3, shuffle=True), rank=0, world_size=2)
    good = loader.state_dict()
    with pytest.raises(ValueError, match=r"DistributedLoader.load_state_dict\(state\)"):
        loader.load_state_dict({**good, **bad})
    assert loader.state_dict() == good and len(list(loader)) == 2  # 5 samples on this rank: 2 batches


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_loader_with_a_distributed_sampler_is_adopted_not_split_twice(
    shuffle: bool, drop_last: bool
) -> None:
    data = list(range(11))
    for rank in range(3):
        theirs = DistributedSampler(
            data, num_replicas=3, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        loader = distributed(DataLoader(data, batch_size=2, sampler=theirs))
        assert (loader.distributed_sampler.rank, loader.distributed_sampler.num_replicas) == (rank, 3)
        for epoch in range(3):  # pass e equals the user's sampler after set_epoch(e)
            reference = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=shuffle, seed=7,
                                           drop_last=drop_last)  # fmt: skip
            reference.set_epoch(epoch)
            assert [x for b in loader for x in b.tolist()] == list(reference)


def test_adopting_a_distributed_sampler_refuses_contradicting_arguments() -> None:
    theirs = DistributedSampler(list(range(8)), num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(list(range(8)), batch_size=2, sampler=theirs)
    with pytest.raises(ValueError, match=r"world_size=4 \(its world_size=2\)"):
        distributed(loader, world_size=4)
    with pytest.raises(ValueError, match=r"seed=9 \(its seed=3\)"):
        distributed(loader, seed=9)
    assert distributed(loader, rank=1, world_size=2, shuffle=True, seed=3).distributed_sampler.seed == 3


def test_adopting_refuses_a_sampler_subclass_or_one_over_another_dataset() -> None:
    class Weighted(DistributedSampler):
        pass

    data = list(range(8))
    theirs = Weighted(data, num_replicas=2, rank=0)
    loader = DataLoader(data, batch_size=2, sampler=theirs)
    with pytest.raises(TypeError, match=r"its sampler is a Weighted, a DistributedSampler subclass"):
        distributed(loader)
    assert loader.sampler is theirs  # the loader handed in is untouched
    other = DistributedSampler(list(range(12)), num_replicas=2, rank=0)
    with pytest.raises(ValueError, match=r"covers 12 samples but the loader's dataset has 8"):
        distributed(DataLoader(data, batch_size=2, sampler=other))


def test_a_distributed_loader_built_by_hand_iterates_and_refuses_only_a_mid_epoch_resume() -> None:
    data = list(range(8))
    loader = DistributedLoader(data, batch_size=2, sampler=DistributedSampler(data, 1, 0, shuffle=False))
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    loader.set_epoch(3)
    assert len(list(loader)) == 4
    with pytest.raises(
        SpeedupsError, match=r"resuming 1 batches into an epoch needs the sampler distributed"
    ):
        loader.load_state_dict({**loader.state_dict(), "batches": 1})


# ------------------------------------------------------------------------------------ streams across ranks
class _Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.arange(float(self.n)))


class _SplitsItself(_Numbers):
    splits_by_rank = True


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_is_read_once_per_epoch_across_2_ranks_and_2_workers(workers: int) -> None:
    seen = []
    per_rank = []
    for r in (0, 1):  # the rank each process of a 2-rank job would have
        loader = distributed(
            DataLoader(_Numbers(12), batch_size=2, num_workers=workers), rank=r, world_size=2
        )
        mine = [int(v) for epoch in range(2) for b in loader for v in b.tolist()]
        seen += mine
        per_rank.append(len(mine))
    assert sorted(seen) == sorted(list(range(12)) * 2)  # two epochs, every sample once in each
    assert per_rank == [12, 12]


def test_an_even_stream_drops_a_partial_last_round_so_ranks_get_as_many_batches() -> None:
    even = [list(distributed(DataLoader(_Numbers(7), batch_size=1), rank=r, world_size=2)) for r in (0, 1)]
    assert [len(b) for b in even] == [3, 3] and torch.cat(
        [*even[0], *even[1]]
    ).sort().values.tolist() == list(map(float, range(6)))
    odd = [
        list(distributed(DataLoader(_Numbers(7), batch_size=1), rank=r, world_size=2, even=False))
        for r in (0, 1)
    ]
    assert [len(b) for b in odd] == [4, 3]  # every sample once, for evaluation


def test_a_stream_that_splits_itself_is_left_whole_and_shuffle_is_refused() -> None:
    loader = distributed(DataLoader(_SplitsItself(6), batch_size=3), rank=1, world_size=2)
    assert [b.tolist() for b in loader] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # its own split: untouched
    with pytest.raises(ValueError, match=r"IterableDataset is read in its own order.* shuffle=None"):
        distributed(DataLoader(_Numbers(6), batch_size=3), shuffle=True, rank=0, world_size=2)


# ------------------------------------ draw order: the DataLoader with a DistributedSampler it replaces
FORK = "fork" in torch.multiprocessing.get_all_start_methods()


def _epochs_and_draws(loader_for_epoch, epochs: int = 3) -> list[torch.Tensor]:
    """Each epoch's batches (with augmentation drawn from torch, random and numpy), then the main
    process's next torch, random and numpy draws, from seed 0 in all three."""
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    seen = []
    for epoch in range(epochs):
        seen.append(torch.cat(list(loader_for_epoch(epoch))))
        seen.append(
            torch.tensor([*torch.rand(3, dtype=torch.float64).tolist(), random.random(), np.random.rand()])
        )
    return seen


@pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")
@pytest.mark.parametrize(
    "workers",
    [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}],
    ids=["0 workers", "2 workers", "2 persistent workers"],
)
@pytest.mark.parametrize("made_by", ["fast_loader", "DataLoader"])
def test_batches_and_main_draws_are_those_of_a_dataloader_with_a_distributed_sampler(
    workers, made_by
) -> None:
    """distributed(loader) draws what the torchrun script it replaces draws (DistributedSampler and
    set_epoch by hand): every batch with its augmentation, and every later draw of the main process."""
    data = Augmented(12)
    kw = workers | ({"multiprocessing_context": "fork"} if workers["num_workers"] else {})
    build = fast_loader if made_by == "fast_loader" else DataLoader
    split = None

    def plain(epoch: int) -> DataLoader:
        nonlocal split
        if split is None:
            sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
            split = DataLoader(data, 4, sampler=sampler, **kw)
        split.sampler.set_epoch(epoch)
        return split

    ours = None

    def mine(epoch: int) -> DataLoader:
        nonlocal ours
        if ours is None:
            ours = distributed(build(data, 4, shuffle=True, **kw), rank=0, world_size=1)
        return ours

    want, got = _epochs_and_draws(plain), _epochs_and_draws(mine)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"epoch {i // 2 + 1}: {'batches' if i % 2 == 0 else 'main draws'} differ"
    assert not torch.equal(want[0], want[2])


@pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")
@pytest.mark.parametrize("workers", [0, 2], ids=["0 workers", "2 persistent workers"])
def test_with_sample_seeds_loading_draws_nothing_from_the_main_process_epoch_after_epoch(workers) -> None:
    data = Augmented(12)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    untouched = [
        torch.tensor([*torch.rand(3, dtype=torch.float64).tolist(), random.random(), np.random.rand()])
        for _ in range(3)
    ]
    loader = distributed(
        fast_loader(data, 4, shuffle=True, sample_seeds=True, num_workers=workers),
        seed=0,
        rank=0,
        world_size=1,
    )
    assert loader.persistent_workers is bool(workers)
    got = _epochs_and_draws(lambda epoch: loader)
    assert all(torch.equal(a, b) for a, b in zip(untouched, got[1::2], strict=True))


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_rank_sampler_emulating_another_layout_deals_its_micro_batches(shuffle: bool) -> None:
    """After a resume on another number of processes, each micro-batch keeps the saving layout's samples:
    2 ranks' batches of 2 dealt in turn to 1 process, and 1 process's batches of 4 dealt to 2 ranks."""
    from speedups.data.rank_sampler import RankSampler

    data = list(range(32))
    saved = []
    for r in (0, 1):
        s = DistributedSampler(data, num_replicas=2, rank=r, shuffle=shuffle, seed=5)
        s.set_epoch(3)
        saved.append(list(s))
    one = RankSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=5, even=True)
    assert one.emulate(2, 2) and len(one) == 32 and one.emulated == (2, 2)
    one.set_epoch(3)
    got = list(one)
    dealt = [saved[r][2 * k : 2 * k + 2] for k in range(8) for r in (0, 1)]  # rank 0's batch k, rank 1's
    assert [got[i : i + 2] for i in range(0, 32, 2)] == dealt
    one.start_at(6)  # a resumed position: 3 micro-batches in
    assert list(one) == got[6:]

    halves = [RankSampler(data, num_replicas=2, rank=r, shuffle=shuffle, seed=5, even=True) for r in (0, 1)]
    for h in halves:
        assert h.emulate(1, 4) and len(h) == 16
        h.set_epoch(3)
    single = RankSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=5, even=True)
    single.set_epoch(3)
    batches = [list(single)[i : i + 4] for i in range(0, 32, 4)]
    for r, h in enumerate(halves):
        mine = list(h)
        assert [mine[i : i + 4] for i in range(0, 16, 4)] == batches[r::2]

    one.start_at(0)
    assert not one.emulate(None) and one.emulated is None and len(one) == 32
    odd = RankSampler(list(range(30)), num_replicas=1, rank=0, shuffle=shuffle, seed=5, even=True)
    assert not odd.emulate(2, 4)  # each saved rank's 15 samples are not whole batches of 4: nothing changes
    assert odd.emulated is None and len(odd) == 30

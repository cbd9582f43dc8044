"""Persistent workers over datasets that carry state, against fresh workers every epoch.

A fresh ``DataLoader`` worker (``persistent_workers=False``) copies the dataset, ``collate_fn`` and
``worker_init_fn`` as the main process holds them when the epoch starts; workers that persist keep their
copy. Each case runs 4 epochs of a loader (2 fork workers, shuffled, draws from torch, ``random`` and numpy
in the workers) against the plain ``DataLoader(..., persistent_workers=False)`` built here, with the same
change to the dataset between epochs: every batch must be equal (``torch.equal``), and the main process's
draws after each epoch. The loader's own workers must persist where nothing changed, restart for the epochs
after a change in the main process, and restart every epoch once the workers change their own copies.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler, Subset, get_worker_info

from speedups import SpeedupsWarning, distributed, fast_loader
from speedups._helpers import compat
from speedups.data.persistence import WorkerReseeding, build_loader, reseeds_workers
from speedups.data.persistence.fingerprint import MAIN, WORKER, Fingerprint
from speedups.data.persistence.worker_restarts import WorkerRestarts
from tests._loading_data import EagerBatches, EagerShuffle

FORK = "fork" in torch.multiprocessing.get_all_start_methods()
pytestmark = pytest.mark.skipif(not FORK, reason="needs the fork start method (fast workers)")
EPOCHS = 4
CHANGED_AFTER = (0, 2)  # a change in the main process after these epochs: epochs 1 and 3 see it


# ------------------------------------------------------------------------------------------------ datasets
class Rows(Dataset):
    """Item i: ``value(i)``, a torch, a ``random`` and a numpy draw of the loading process, and its pid."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def value(self, i: int) -> float:
        return float(i)

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor([self.value(i), *draws, os.getpid()], dtype=torch.float64)


class TensorLabels(Rows):
    """Pseudo-labels in a tensor, rewritten in place between epochs (``ds.labels[:] = ...``)."""

    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.labels = torch.zeros(n, dtype=torch.float64)

    def value(self, i: int) -> float:
        return i + 100 * float(self.labels[i])


class Scaled(Rows):
    """An attribute the main process (or ``worker_init_fn``) reassigns."""

    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.scale = 1.0

    def value(self, i: int) -> float:
        return i * self.scale


class ArrayLabels(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.labels = np.zeros(n)

    def value(self, i: int) -> float:
        return i + 100 * float(self.labels[i])


class ListLabels(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.labels = [0] * n

    def value(self, i: int) -> float:
        return i + 100 * self.labels[i]


class Table(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.table = {"offset": 0.0}

    def value(self, i: int) -> float:
        return i + self.table["offset"]


class Shift:
    """A transform object with a setting (``by``)."""

    def __init__(self) -> None:
        self.by = 0.0

    def __call__(self, x: float) -> float:
        return x + self.by


class Transformed(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.transform = Shift()

    def value(self, i: int) -> float:
        return self.transform(float(i))


class ShiftCollate:
    """A collate_fn object with a setting (``by``) the main process changes."""

    def __init__(self) -> None:
        self.by = 0.0

    def __call__(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out = torch.stack(batch)
        out[:, 0] += self.by
        return out


class OwnTorchGenerator(Rows):
    """Draws from a ``torch.Generator`` of its own: a fresh worker starts from the main process's state."""

    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.g = torch.Generator().manual_seed(0)

    def value(self, i: int) -> float:
        return i + torch.rand((), generator=self.g, dtype=torch.float64).item()


class OwnNumpyGenerator(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.rng = np.random.default_rng(0)

    def value(self, i: int) -> float:
        return i + float(self.rng.random())


class OwnRandom(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.rng = random.Random(0)

    def value(self, i: int) -> float:
        return i + self.rng.random()


class Jitter:
    """A transform holding a numpy ``RandomState`` of its own (one level below the dataset)."""

    def __init__(self) -> None:
        self.rng = np.random.RandomState(0)

    def __call__(self, x: float) -> float:
        return x + float(self.rng.rand())


class GeneratorInTransform(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.transform = Jitter()

    def value(self, i: int) -> float:
        return self.transform(float(i))


class Counting(Rows):
    """``__getitem__`` changes the dataset's own state: the items it has loaded."""

    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.calls = 0

    def value(self, i: int) -> float:
        self.calls += 1
        return i + 1000 * self.calls


class NoiseCollate:
    """A collate_fn holding a generator of its own."""

    def __init__(self) -> None:
        self.g = torch.Generator().manual_seed(1)

    def __call__(self, batch: list[torch.Tensor]) -> torch.Tensor:
        out = torch.stack(batch)
        out[:, 0] += torch.rand(len(batch), generator=self.g, dtype=torch.float64)
        return out


class Handle:
    """Stands for a file or database handle (h5py, LMDB) a dataset opens in the worker at its first item."""

    def __init__(self, path: str) -> None:
        self.path = path


class LazilyOpened(Rows):
    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.handle: Handle | None = None

    def value(self, i: int) -> float:
        if self.handle is None:
            self.handle = Handle("data.h5")
        return float(i)


def scale_up(worker_id: int) -> None:
    """A worker_init_fn that adjusts its worker's copy of the dataset, relative to what it holds."""
    dataset = get_worker_info().dataset
    dataset.scale = dataset.scale * 10


# ------------------------------------------------------------------------------------------------ the cases
def _rewrite_tensor(ds: Any, epoch: int) -> None:
    ds.labels[:] = torch.arange(len(ds.labels), dtype=torch.float64) * (epoch + 1)


def _rewrite_array(ds: Any, epoch: int) -> None:
    ds.labels[:] = np.arange(len(ds.labels)) * (epoch + 1)


def _set_one_label(ds: Any, epoch: int) -> None:
    ds.labels[epoch + 3] = epoch + 1


def _reassign(ds: Any, epoch: int) -> None:
    ds.scale = float(epoch + 2)


def _offset(ds: Any, epoch: int) -> None:
    ds.table["offset"] = 10.0 * (epoch + 1)


def _shift(ds: Any, epoch: int) -> None:
    ds.transform.by = float(epoch + 1)


class Case:
    """A dataset, what the main process changes after the epochs in :data:`CHANGED_AFTER`, the loader's
    extra arguments, and how its workers must behave: ``"persist"``, ``"after changes"`` (restart in the
    epochs after a change only) or ``"every epoch"`` (restart from epoch 1 on)."""

    def __init__(
        self,
        make: Callable[[], Any],
        change: Callable[[Any, int], None] | None = None,
        workers: str = "after changes",
        **extra: Any,
    ) -> None:
        self.make, self.change, self.workers, self.extra = make, change, workers, extra


def _collate_case() -> Case:
    collate = ShiftCollate()

    def change(ds: Any, epoch: int) -> None:
        collate.by = float(epoch + 1)

    return Case(Rows, change, collate_fn=collate)


MAIN_CHANGES = {
    "tensor changed in place": lambda: Case(TensorLabels, _rewrite_tensor),
    "attribute reassigned": lambda: Case(Scaled, _reassign),
    "numpy array changed in place": lambda: Case(ArrayLabels, _rewrite_array),
    "one element of a list": lambda: Case(ListLabels, _set_one_label),
    "dict changed in place": lambda: Case(Table, _offset),
    "a transform object's setting": lambda: Case(Transformed, _shift),
    "a collate_fn object's setting": _collate_case,
    "the dataset inside a Subset": lambda: Case(
        lambda: Subset(TensorLabels(16), list(range(2, 14))), lambda ds, e: _rewrite_tensor(ds.dataset, e)
    ),
    "a dataset inside a ConcatDataset": lambda: Case(
        lambda: ConcatDataset([Rows(6), TensorLabels(6)]), lambda ds, e: _rewrite_tensor(ds.datasets[1], e)
    ),
}
WORKER_CHANGES = {
    "owns a torch.Generator": lambda: Case(OwnTorchGenerator, workers="every epoch"),
    "owns a numpy Generator": lambda: Case(OwnNumpyGenerator, workers="every epoch"),
    "owns a random.Random": lambda: Case(OwnRandom, workers="every epoch"),
    "a RandomState one level down": lambda: Case(GeneratorInTransform, workers="every epoch"),
    "__getitem__ counts its calls": lambda: Case(Counting, workers="every epoch"),
    "worker_init_fn changes the copy": lambda: Case(Scaled, workers="every epoch", worker_init_fn=scale_up),
    "a collate_fn with its own generator": lambda: Case(
        Rows, workers="every epoch", collate_fn=NoiseCollate()
    ),
}


def _shared_labels() -> TensorLabels:
    data = TensorLabels()
    data.labels.share_memory_()  # changes in place reach live workers, as they reach fresh ones
    return data


UNCHANGED = {
    "a dataset without state": lambda: Case(Rows, workers="persist"),
    "a TensorDataset": lambda: Case(
        lambda: torch.utils.data.TensorDataset(torch.randn(12, 3, dtype=torch.float64), torch.arange(12)),
        workers="persist",
    ),
    "a tensor in shared memory changed in place": lambda: Case(_shared_labels, _rewrite_tensor, "persist"),
    "a handle opened at the first item": lambda: Case(LazilyOpened, workers="persist"),
}


# ------------------------------------------------------------------------------------------------- the runs
class Run:
    """``EPOCHS`` epochs of a loader from seed 0 in torch, ``random`` and numpy: each epoch's batches (the
    pid column apart), the processes that loaded them, the main process's draws after it, and warnings."""

    def __init__(self, case: Case, build: Callable[[Any, Case], DataLoader], set_epoch: bool = False) -> None:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        data = case.make()
        self.batches: list[list[torch.Tensor]] = []
        self.pids: list[set[int]] = []
        self.after: list[Any] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = build(data, case)
            for epoch in range(EPOCHS):
                if set_epoch:
                    loader.sampler.set_epoch(epoch)
                batches = [_rows(batch) for batch in loader]
                self.batches.append([b[:, :-1] for b in batches])
                self.pids.append({int(p) for b in batches for p in b[:, -1].tolist()})
                generator = None if loader.generator is None else loader.generator.get_state().tolist()
                draws = torch.rand(3).tolist(), random.random(), float(np.random.rand())
                self.after.append((*draws, generator))
                if case.change is not None and epoch in CHANGED_AFTER:
                    case.change(data, epoch)
        self.loader = loader
        self.warned = [w for w in caught if issubclass(w.category, SpeedupsWarning)]


def _rows(batch: Any) -> torch.Tensor:
    """A batch as a float64 matrix whose last column is the pid (a TensorDataset's: its x, y and pid 0)."""
    if isinstance(batch, list):  # TensorDataset's (x, y): no pid, no worker draws
        x, y = batch
        return torch.cat([x, y[:, None].to(torch.float64), torch.zeros(len(y), 1, dtype=torch.float64)], 1)
    return batch if batch.dim() == 2 else batch[None]  # one item (batch_size=None)


def _kwargs(case: Case) -> dict[str, Any]:
    return {"num_workers": 2, "multiprocessing_context": "fork", **case.extra}


def _plain(data: Any, case: Case) -> DataLoader:
    return DataLoader(data, 3, shuffle=True, **_kwargs(case))


def _fast(data: Any, case: Case) -> DataLoader:
    return fast_loader(data, 3, shuffle=True, **_kwargs(case))


def _plain_split(data: Any, case: Case) -> DataLoader:
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, 3, sampler=sampler, **_kwargs(case))


def _distributed_fast(data: Any, case: Case) -> DataLoader:
    return distributed(_fast(data, case), rank=0, world_size=1)


def _distributed_plain(data: Any, case: Case) -> DataLoader:
    return distributed(_plain(data, case), rank=0, world_size=1)


BUILDS = {
    "fast_loader": (_fast, _plain, False),
    "distributed(fast_loader)": (_distributed_fast, _plain_split, True),
    "distributed(DataLoader)": (_distributed_plain, _plain_split, True),
}
# fast_loader in the quick loop; the same kinds through distributed() with the slow tests
MADE_BY = [pytest.param(name, marks=[pytest.mark.slow] if name != "fast_loader" else []) for name in BUILDS]


def _check(new_case: Callable[[], Case], made_by: str) -> None:
    """``new_case()`` for each run: what the main process changes is its own."""
    build, reference, set_epoch = BUILDS[made_by]
    plain = Run(new_case(), reference, set_epoch=set_epoch)
    mine = Run(case := new_case(), build)
    assert reseeds_workers(mine.loader), "the loader's workers persist exactly"
    for epoch in range(EPOCHS):
        want, got = plain.batches[epoch], mine.batches[epoch]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), (
            f"epoch {epoch}: the batches differ from fresh workers'"
        )
        assert mine.after[epoch] == plain.after[epoch], f"after epoch {epoch}: the main draws differ"
    if case.workers != "persist" and made_by == "fast_loader":  # the control: workers kept regardless
        with mock.patch.object(WorkerRestarts, "reason", lambda self, watched: None):
            kept = Run(new_case(), build)
        assert kept.pids[0] == kept.pids[-1], "the control restarted its workers"
        assert any(
            not all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            for want, got in zip(plain.batches, kept.batches, strict=True)
        ), "a trivial case: workers kept alive regardless yield the same"
    same = [mine.pids[e] == mine.pids[e - 1] for e in range(1, EPOCHS)]
    if case.workers == "persist":
        assert all(same), f"workers restarted: {mine.pids}"
        assert not mine.warned, [str(w.message) for w in mine.warned]
    else:
        expected = [e - 1 not in CHANGED_AFTER for e in range(1, EPOCHS)]
        assert same == ([False] * (EPOCHS - 1) if case.workers == "every epoch" else expected), mine.pids
        assert len(mine.warned) == 1, [str(w.message) for w in mine.warned]  # one warning, at the first
        assert mine.warned[0].filename == __file__  # pointing at the loop


@pytest.mark.parametrize("made_by", MADE_BY)
@pytest.mark.parametrize("kind", list(MAIN_CHANGES))
def test_a_change_in_the_main_process_reaches_the_next_epoch_through_fresh_workers(kind: str, made_by: str):
    _check(MAIN_CHANGES[kind], made_by)


@pytest.mark.parametrize("made_by", MADE_BY)
@pytest.mark.parametrize("kind", list(WORKER_CHANGES))
def test_a_worker_that_changes_its_copy_is_replaced_by_fresh_ones_every_epoch(kind: str, made_by: str):
    _check(WORKER_CHANGES[kind], made_by)


@pytest.mark.parametrize("made_by", MADE_BY)
@pytest.mark.parametrize("kind", list(UNCHANGED))
def test_workers_persist_where_their_copy_stays_what_fresh_ones_copy(kind: str, made_by: str):
    _check(UNCHANGED[kind], made_by)


@pytest.mark.parametrize(
    "ordering",
    [
        {"batch_size": None, "sampler": EagerShuffle(12)},
        {"batch_size": 1, "batch_sampler": EagerBatches(12)},
    ],
    ids=["eager sampler, batch_size=None", "eager batch_sampler"],
)
@pytest.mark.parametrize("kind", ["tensor changed in place", "owns a torch.Generator"])
def test_a_restart_makes_a_fresh_iterators_draws_where_torch_iterates_the_sampler_itself(kind, ordering):
    """A sampler torch iterates directly draws its order at iter(): a fresh iterator calls it once before
    its base-seed draw and once after; a pass that restarts its workers keeps that order of draws."""
    new_case = {**MAIN_CHANGES, **WORKER_CHANGES}[kind]

    def plain(data: Any, case: Case) -> DataLoader:
        return DataLoader(data, **ordering, **_kwargs(case))

    def mine(data: Any, case: Case) -> DataLoader:
        return fast_loader(data, **ordering, **_kwargs(case))

    want, got = Run(new_case(), plain), Run(new_case(), mine)
    for epoch in range(EPOCHS):
        a, b = want.batches[epoch], got.batches[epoch]
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"epoch {epoch}"
        assert got.after[epoch] == want.after[epoch], f"after epoch {epoch}"
    assert got.pids[1] != got.pids[0] and len(got.warned) == 1


# ---------------------------------------------------------------------------------------- the fingerprint
def test_the_fingerprint_sees_changes_in_place_and_names_them() -> None:
    data = TensorLabels(4)
    data.extra = {"rows": [1, 2, 3], "array": np.zeros(3), "gen": torch.Generator().manual_seed(0)}
    before = Fingerprint({"dataset": data})
    assert Fingerprint({"dataset": data}) == before
    data.labels[1] = 5.0
    data.extra["rows"][2] = 4
    data.extra["array"][0] = 1.0
    torch.rand(1, generator=data.extra["gen"])
    after = Fingerprint({"dataset": data})
    assert after.changed(before) == [
        "dataset.extra['array']",
        "dataset.extra['gen']",
        "dataset.extra['rows']",
        "dataset.labels",
    ]
    assert not before.cut
    data.labels.share_memory_()  # moved: a new pointer
    shared = Fingerprint({"dataset": data})
    data.labels[0] = 7.0  # in shared memory: no version
    assert Fingerprint({"dataset": data}) == shared


def test_the_fingerprint_is_bounded_and_says_what_it_left() -> None:
    big = Rows()
    big.labels = list(range(MAIN.items * 3))
    big.pixels = np.zeros(MAIN.nbytes + 8, dtype=np.uint8)
    before = Fingerprint({"dataset": big})
    assert before.cut and not Fingerprint({"dataset": Rows()}).cut
    big.labels[0] = -1  # sampled at element 0: seen
    assert Fingerprint({"dataset": big}).changed(before) == ["dataset.labels"]
    deep = Rows()
    deep.a = Shift()
    deep.a.b = Shift()
    deep.a.b.c = Shift()
    deep.a.b.c.d = Shift()
    mark = Fingerprint({"dataset": deep}, WORKER)
    assert mark.cut and "dataset.a.b.c.by" in mark.tokens and "dataset.a.b.c.d.by" not in mark.tokens


def test_a_handle_opened_lazily_is_no_change_but_a_generator_set_so_is() -> None:
    data = LazilyOpened()
    before = Fingerprint({"dataset": data}, WORKER)
    data.value(0)
    now = Fingerprint({"dataset": data}, WORKER)
    assert now.opened_lazily(before, now.changed(before))
    data.handle = None
    data.rng = np.random.default_rng(0)  # a generator set lazily is state, not a handle
    now = Fingerprint({"dataset": data}, WORKER)
    assert not now.opened_lazily(before, now.changed(before))


# ---------------------------------------------------------------------------------------- torch internals
def test_this_torch_lets_a_pass_swap_its_workers_and_an_older_one_gets_fresh_workers(monkeypatch) -> None:
    """compat.restarts_loader_workers reads DataLoader.__iter__; where it cannot swap the live iterator,
    the builder gives torch's fresh workers every epoch (exact, not persistent)."""
    assert compat.restarts_loader_workers()
    data = Rows()
    exact = build_loader(DataLoader, data, batch_size=3, num_workers=2, persistent_workers="exact")
    assert exact.persistent_workers and isinstance(exact.dataset, WorkerReseeding)
    monkeypatch.setattr(compat, "restarts_loader_workers", lambda: False)
    plain = build_loader(DataLoader, data, batch_size=3, num_workers=2, persistent_workers="exact")
    assert plain.persistent_workers is False and plain.dataset is data


def test_iterating_the_sampler_by_hand_between_epochs_restarts_nothing() -> None:
    data = TensorLabels()
    loader = fast_loader(data, 3, num_workers=1, multiprocessing_context="fork")
    first = [b[:, -1].tolist() for b in loader]
    _rewrite_tensor(data, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        assert len(list(loader.sampler)) == 12  # keys, not a pass of the workers
    with pytest.warns(SpeedupsWarning, match=r"dataset\.labels changed in the main process"):
        second = [b for b in loader]  # the workers restart here, at the pass
    assert {p for b in second for p in b[:, -1].tolist()} != {p for b in first for p in b}
    assert [float(b[0, 0]) for b in second][1] == 3 + 100 * 3  # the new labels


# ------------------------------------------------------------------------------------------------- spawn
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "restarts"),
    [
        ("attribute reassigned", True),
        ("worker_init_fn changes the copy", True),
        ("tensor changed in place", False),  # spawn's pickling put it in shared memory: the workers see it
    ],
)
def test_spawned_workers_restart_where_their_copy_changed(kind: str, restarts: bool) -> None:
    new_case = {**MAIN_CHANGES, **WORKER_CHANGES}[kind]

    def spawned(build: Callable[..., DataLoader]) -> Callable[[Any, Case], DataLoader]:
        def make(data: Any, case: Case) -> DataLoader:
            kw = _kwargs(case) | {"multiprocessing_context": "spawn", "num_workers": 1}
            return build(data, 3, shuffle=True, **kw)

        return make

    plain, mine = Run(new_case(), spawned(DataLoader)), Run(new_case(), spawned(fast_loader))
    for epoch in range(EPOCHS):
        assert all(torch.equal(a, b) for a, b in zip(plain.batches[epoch], mine.batches[epoch], strict=True))
        assert mine.after[epoch] == plain.after[epoch]
    assert (mine.pids[1] != mine.pids[0]) is restarts and len(mine.warned) == restarts


def test_the_wrapper_reads_through_to_the_datasets_own_attributes() -> None:
    """What the workers' watch keeps on loader.dataset is private: a dataset's own collate_fn, watch or
    watched still read (and write) through."""
    data = Rows()
    data.collate_fn, data.watch, data.watched = "mine", 1, 2
    loader = fast_loader(data, 3, num_workers=1, multiprocessing_context="fork")
    assert isinstance(loader.dataset, WorkerReseeding)
    assert (loader.dataset.collate_fn, loader.dataset.watch, loader.dataset.watched) == ("mine", 1, 2)
    loader.dataset.watch = 3
    assert data.watch == 3

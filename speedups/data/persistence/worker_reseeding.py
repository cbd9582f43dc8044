"""The worker side of persistent workers that load what fresh ones load: each pass's first item reseeds, and
each worker watches its copy of the dataset.

torch's persistent workers are seeded once, when they start; fresh workers (``persistent_workers=False``)
are seeded at every epoch from a base seed the main process draws. :class:`WorkerReseeding` wraps the
dataset so that a worker kept alive reseeds itself, as a fresh worker would have been seeded, when the first
key of a new pass reaches it; the key carries that pass's base seed from the main process
(:class:`~speedups.data.persistence.EpochSeeds`). It also tells the main process when the worker's copy
of the dataset no longer is what a fresh worker would copy (:class:`~speedups.data.persistence.worker_watch.
WorkerWatch`).
"""

from __future__ import annotations

import os
import random
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils.data import get_worker_info

from speedups._helpers import compat
from speedups._helpers.rng import numpy_or_none
from speedups.data.persistence.worker_watch import WorkerWatch
from speedups.data.read_through import ReadThrough

__all__ = ["EPOCH_KEY", "WorkerReseeding", "is_epoch_key"]

EPOCH_KEY = "speedups.epoch_key"
"""The first element of a key ``(EPOCH_KEY, index, pass, base_seed)``: it tells a key from an index."""


def is_epoch_key(key: Any) -> bool:
    """Whether ``key`` is one :class:`~speedups.data.persistence.EpochSeeds` handed out."""
    return type(key) is tuple and len(key) == 4 and isinstance(key[0], str) and key[0] == EPOCH_KEY


class WorkerReseeding(ReadThrough):
    """A map-style dataset whose loader worker reseeds itself at the first item of each new pass.

    Each key ``(EPOCH_KEY, index, pass, base_seed)`` loads ``dataset[index]`` (a key whose ``index`` is a
    whole batch, from a batch sampler, loads that batch). When a key's ``pass`` differs from the last one
    this worker loaded and carries a ``base_seed``, the worker first does what torch's ``_worker_loop``
    does when a fresh worker starts: ``random`` and torch's generator seeded with ``base_seed + id``, numpy's
    global ``RandomState`` from ``(base_seed, id)`` (if numpy imports), ``get_worker_info().seed`` set to
    ``base_seed + id``, then ``worker_init_fn(id)``. So the items of every pass are drawn as a fresh
    worker would draw them. A batch goes to the dataset's own ``__getitems__`` when it has one, else item by
    item, as torch's fetcher does. A plain index (``loader.dataset[3]``) loads the item as it is.

    With a ``watch``, each worker records the dataset, ``collate_fn`` and ``worker_init_fn`` it holds as it
    starts (when forked, or unpickled under ``spawn``/``forkserver``: before ``worker_init_fn``) and
    compares them after ``worker_init_fn`` and after each batch it loads; a change is flagged to the main
    process, which then starts fresh workers (a change ``collate_fn`` makes shows at the worker's next batch).

    Every attribute but ``dataset`` and ``worker_init_fn`` is read from, written to and deleted from the
    wrapped dataset (``loader.dataset.classes``, ``get_worker_info().dataset.start = 0``);
    ``isinstance(loader.dataset, MyDataset)`` is False: use ``loader.dataset.dataset``. Pickles (spawn) when
    the dataset and ``worker_init_fn`` do.

    Args:
        dataset: a map-style dataset.
        worker_init_fn: the loader's ``worker_init_fn`` (None: none), called again at each new pass.
        collate_fn: the loader's ``collate_fn`` (watched only).
        watch: where workers flag a change of their copy (None: not watched).
    """

    _OWN: ClassVar[frozenset[str]] = frozenset(
        {"dataset", "worker_init_fn", "_collate_fn", "_watch", "_pass"}
    )
    _pass: int | None
    _watch: WorkerWatch | None

    def __init__(
        self,
        dataset: Any,
        worker_init_fn: Callable[[int], object] | None = None,
        collate_fn: Callable[[Any], Any] | None = None,
        watch: WorkerWatch | None = None,
    ) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "worker_init_fn", worker_init_fn)
        object.__setattr__(self, "_collate_fn", collate_fn)
        object.__setattr__(self, "_watch", watch)
        object.__setattr__(self, "_pass", None)  # the pass this (worker's copy of the) dataset last loaded
        if watch is not None:
            _watch_forks(self)

    def _watched(self) -> dict[str, Any]:
        """What a fresh worker copies from the main process and a persistent one keeps."""
        return {
            "dataset": self.dataset,
            "collate_fn": self._collate_fn,
            "worker_init_fn": self.worker_init_fn,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        if self._watch is not None:  # unpickled in a spawned worker, before worker_init_fn runs
            self._watch.start(self._watched())

    def __getitems__(self, keys: Any) -> list[Any]:
        """Load a batch: a batch key, a list of keys (of one pass), or plain indices."""
        keyed = True
        if is_epoch_key(keys):  # a batch sampler's batch, as it made it
            self._enter(keys)
            indices = keys[1]
        elif isinstance(keys, list) and keys and is_epoch_key(keys[0]):
            self._enter(keys[0])  # the keys of a batch share their pass
            indices = [key[1] for key in keys]
        else:
            indices, keyed = keys, False
        own = getattr(self.dataset, "__getitems__", None)
        out = own(indices) if own else [self.dataset[index] for index in indices]  # what torch's fetcher does
        if keyed and self._watch is not None:
            self._watch.check(self._watched(), WorkerWatch.LOADING)
        return out

    def __getitem__(self, key: Any) -> Any:
        if not is_epoch_key(key):
            return self.dataset[key]
        self._enter(key)
        item = self.dataset[key[1]]
        if self._watch is not None:
            self._watch.check(self._watched(), WorkerWatch.LOADING)
        return item

    def _enter(self, key: tuple[str, Any, int, int | None]) -> None:
        """At the first key of a new pass, reseed this worker as torch seeds a fresh one."""
        _, _, number, base_seed = key
        if number == self._pass:
            return
        self._pass = number
        info = get_worker_info()
        if info is None:  # no worker: the main process loads
            return
        if base_seed is not None:  # a later pass of a live worker (in the first, torch seeded it)
            seed = base_seed + info.id
            random.seed(seed)
            torch.manual_seed(seed)
            np = numpy_or_none()
            if np is not None:
                np.random.seed(compat.worker_numpy_seed(base_seed, info.id))
            compat.set_worker_seed(info, seed)
            if self.worker_init_fn is not None:
                self.worker_init_fn(info.id)
        if self._watch is not None:  # worker_init_fn has run, in this pass or as the worker started
            self._watch.check(self._watched(), WorkerWatch.INIT)

    def __repr__(self) -> str:
        return f"WorkerReseeding({self.dataset!r})"


_FORKABLE: weakref.WeakSet[WorkerReseeding] = weakref.WeakSet()  # watched wrappers a fork may copy
_HOOKED: list[bool] = []  # os.register_at_fork has no undo: registered once per process


def _watch_forks(wrapper: WorkerReseeding) -> None:
    """Have every process forked from this one record ``wrapper``'s watched objects as it starts (a forked
    worker's copy before ``worker_init_fn`` runs), while ``wrapper`` lives."""
    if not _HOOKED and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_record_forked)
        _HOOKED.append(True)
    _FORKABLE.add(wrapper)


def _record_forked() -> None:
    """In a process just forked: each watched wrapper records its copy (bounded: a few µs each)."""
    for wrapper in list(_FORKABLE):
        try:
            wrapper._watch.start(wrapper._watched())  # type: ignore[union-attr]
        except Exception:  # never fail a fork: that wrapper stays unwatched here
            continue

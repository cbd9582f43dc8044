"""The sampler side of persistent workers that draw what fresh ones draw: each pass draws its base seed, or
starts fresh workers where the live ones would not load what fresh ones load.

A ``DataLoader`` with ``persistent_workers=False`` draws its workers' base seed from its ``generator`` (else
the global torch RNG) every time an iterator is made; with persistent workers, torch makes the iterator
once and later passes draw nothing. :class:`EpochSeeds` makes each later pass draw that seed, at the point
of the sequence where a fresh iterator draws it, and hands it to the workers with every index, as keys for
:class:`~speedups.data.persistence.WorkerReseeding`. Where the workers' copy of the dataset is no longer what
fresh workers would copy, it has the pass start fresh workers instead
(:class:`~speedups.data.persistence.worker_restarts.WorkerRestarts`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from speedups._helpers import compat
from speedups.data.persistence.worker_reseeding import EPOCH_KEY
from speedups.data.persistence.worker_restarts import WorkerRestarts
from speedups.data.persistence.worker_watch import WorkerWatch

__all__ = ["EpochSeeds"]


class EpochSeeds(Sampler):
    """Wrap a loader's sampler (or batch sampler) so each index of a pass comes out as a key
    ``(EPOCH_KEY, index, pass, base_seed)``.

    ``base_seed`` is None in a pass whose workers start in it (the loader's first, or one that restarts
    them): torch draws it and seeds the workers as they start. In a later pass of the loader's persistent
    iterator it is drawn here, from the loader's ``generator`` (else the global torch RNG), exactly as
    ``_BaseDataLoaderIter.__init__`` draws it, and in the same order among the other draws of a fresh
    iterator: the wrapped sampler's ``iter()`` (where torch reads it directly, ``index_sampler=True``: the
    whole batch sampler, or the sampler without automatic batching), the base seed, then the sampler's
    ``iter()`` again and its indices (a ``RandomSampler`` draws its own seed at its first index). So the
    main process's random streams advance as with fresh workers, epoch after epoch. The draw happens at the
    pass's first index, which torch takes inside ``iter(loader)``.

    There too, before the draw, the loader's :class:`~speedups.data.persistence.worker_restarts.
    WorkerRestarts` is asked whether the live workers still hold what fresh ones would copy (the dataset,
    ``collate_fn`` and ``worker_init_fn`` unchanged in the main process since they started, and unchanged in
    the workers); if not, the pass gets a fresh iterator instead, whose workers copy them as they are now and
    whose base seed torch draws: the pass then makes the draws of a fresh ``DataLoader`` iterator, in order.

    Iterating it by hand after the loader's first pass (``list(loader.sampler)``) draws a base seed too:
    read ``loader.sampler.sampler``, the wrapped one. Every other attribute (``set_epoch``, ``generator``,
    ``batch_size``) is the wrapped sampler's. ``len()`` is the wrapped sampler's. It holds its loader weakly
    (:meth:`bind`) and cannot be pickled, as a loader with live workers cannot.

    Args:
        sampler: yields indices (or batches of them: a batch sampler).
        index_sampler: torch iterates it directly (a batch sampler, or a sampler with ``batch_size=None``);
            False where ``DataLoader``'s own ``BatchSampler`` reads it.
    """

    _OWN = frozenset({"sampler", "index_sampler", "passes", "_loader", "_dataset", "_restarts", "_handoff"})
    _loader: weakref.ref[Any] | None
    _restarts: WorkerRestarts | None
    _handoff: Iterator[Any] | None

    def __init__(self, sampler: Any, *, index_sampler: bool) -> None:
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "index_sampler", index_sampler)
        object.__setattr__(self, "passes", 0)
        object.__setattr__(self, "_loader", None)
        object.__setattr__(self, "_dataset", None)
        object.__setattr__(self, "_restarts", None)
        object.__setattr__(self, "_handoff", None)  # the sampler iterator a restarted pass already made

    def bind(self, loader: Any, dataset: Any, watch: WorkerWatch | None = None) -> None:
        """Draw the base seeds of ``loader``'s later passes (held weakly: the loader holds this sampler), and
        restart its workers where ``dataset`` (the user's), the loader's ``collate_fn`` or ``worker_init_fn``
        changed since they started, or ``watch`` (the one its workers set) says theirs did."""
        self._loader = weakref.ref(loader)
        self._dataset = dataset
        self._restarts = None if watch is None else WorkerRestarts(watch)

    @property
    def restarts(self) -> int:
        """How many passes started fresh workers in place of the live ones (0 when none was needed)."""
        return 0 if self._restarts is None else self._restarts.restarts

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # the wrapped sampler's state (``loader.sampler.epoch = 3``) is the wrapped sampler's
            setattr(self.sampler, name, value)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        # A fresh iterator calls iter() on the index sampler where this is called: whatever the wrapped
        # sampler does then (an eager permutation) happens now too. Its indices wait for the first next().
        # A pass that restarts its workers made that call already: the fresh iterator's first is that one.
        first, self._handoff = self._handoff, None
        if first is None and self.index_sampler:
            first = iter(self.sampler)
        return self._keys(first)

    def _keys(self, first: Iterator[Any] | None) -> Iterator[Any]:
        loader = None if self._loader is None else self._loader()
        base_seed = None
        if loader is not None and compat.live_loader_iterator(loader) is None:
            if self._restarts is not None:  # the workers start now, copying what they are given
                self._restarts.started(self._watched(loader))
        elif loader is not None:  # a later pass of the live workers
            if self._restart(loader, first):
                return  # this (old) iterator's pass is empty: the loop gets the fresh iterator
            # what a fresh iterator draws in _BaseDataLoaderIter.__init__, then its second iter()
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
            first = None
        # Not held while the pass yields: this generator lives in the loader's iterator, so a reference to the
        # loader here would make the loader, its iterator and its queues one reference cycle, which the
        # collector frees together, the queues' feeder threads first; the iterator's shutdown then sent its
        # workers nothing and waited 20 s for them (a loader dropped in the middle of a pass).
        del loader
        self.passes += 1
        number = self.passes
        for index in self.sampler if first is None else first:
            yield (EPOCH_KEY, index, number, base_seed)

    def _restart(self, loader: Any, first: Iterator[Any] | None) -> bool:
        """Give this pass fresh workers if the live ones would not load what fresh ones load; whether it did.

        Only inside torch's reset of the live iterator (not a sampler iterated by hand); the fresh iterator
        is built here (its workers start, torch draws its base seed, it calls ``iter()`` on this sampler,
        its first call answered with ``first``, the one this pass made) and replaces the live one.
        """
        if self._restarts is None or not compat.loader_iterator_resetting(loader):
            return False
        watched = self._watched(loader)
        reason = self._restarts.reason(watched)
        if reason is None:
            return False
        self._handoff = first
        try:
            self._restarts.restart(loader, reason, watched)
        finally:
            self._handoff = None
        return True

    def _watched(self, loader: Any) -> dict[str, Any]:
        """What fresh workers of ``loader`` would copy from the main process."""
        return {
            "dataset": self._dataset,
            "collate_fn": loader.collate_fn,
            "worker_init_fn": loader.worker_init_fn,
        }

    def __repr__(self) -> str:
        return f"EpochSeeds({self.sampler!r}, index_sampler={self.index_sampler})"

"""The sampler side of persistent workers that draw what fresh ones draw: each pass draws its base seed.

A ``DataLoader`` with ``persistent_workers=False`` draws its workers' base seed from its ``generator`` (else
the global torch RNG) every time an iterator is made; with persistent workers, torch makes the iterator
once and later passes draw nothing. :class:`EpochSeeds` makes each later pass draw that seed, at the point
of the sequence where a fresh iterator draws it, and hands it to the workers with every index, as keys for
:class:`~speedups.data.persistence.worker_reseeding.WorkerReseeding`.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from speedups._helpers import compat, env
from speedups.data.persistence.dataset_state import Snapshot, attribute_ids, reassigned
from speedups.data.persistence.worker_reseeding import EPOCH_KEY
from speedups.errors import SpeedupsWarning

__all__ = ["EpochSeeds"]


class EpochSeeds(Sampler):
    """Wrap a loader's sampler (or batch sampler) so each index of a pass comes out as a key
    ``(EPOCH_KEY, index, pass, base_seed)``.

    ``base_seed`` is None in the loader's first pass (torch draws it and seeds the workers as they start).
    In a later pass of the loader's persistent iterator it is drawn here, from the loader's ``generator``
    (else the global torch RNG), exactly as ``_BaseDataLoaderIter.__init__`` draws it, and in the same
    order among the other draws of a fresh iterator: the wrapped sampler's ``iter()`` (where torch reads it
    directly, ``index_sampler=True``: the whole batch sampler, or the sampler without automatic batching),
    the base seed, then the sampler's ``iter()`` again and its indices (a ``RandomSampler`` draws its own
    seed at its first index). So the main process's random streams advance as with fresh workers, epoch
    after epoch. The draw happens at the pass's first index, which torch takes inside ``iter(loader)``.

    Workers keep the dataset they copied when they started: an attribute of it reassigned in the main process
    since (``dataset.epoch = 3``) gets one :class:`~speedups.SpeedupsWarning` at the next pass, naming it.

    Iterating it by hand after the loader's first pass (``list(loader.sampler)``) draws a base seed too:
    read ``loader.sampler.sampler``, the wrapped one. Every other attribute (``set_epoch``, ``generator``,
    ``batch_size``) is the wrapped sampler's. ``len()`` is the wrapped sampler's. It holds its loader weakly
    (:meth:`bind`) and cannot be pickled, as a loader with live workers cannot.

    Args:
        sampler: yields indices (or batches of them: a batch sampler).
        index_sampler: torch iterates it directly (a batch sampler, or a sampler with ``batch_size=None``);
            False where ``DataLoader``'s own ``BatchSampler`` reads it.
    """

    _OWN = frozenset({"sampler", "index_sampler", "passes", "_loader", "_dataset", "_started", "_warned"})
    _loader: weakref.ref[Any] | None
    _started: Snapshot | None
    _warned: bool

    def __init__(self, sampler: Any, *, index_sampler: bool) -> None:
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "index_sampler", index_sampler)
        object.__setattr__(self, "passes", 0)
        object.__setattr__(self, "_loader", None)
        object.__setattr__(self, "_dataset", None)
        object.__setattr__(self, "_started", None)  # the dataset's attributes when the workers started
        object.__setattr__(self, "_warned", False)

    def bind(self, loader: Any, dataset: Any) -> None:
        """Draw the base seeds of ``loader``'s later passes (held weakly: the loader holds this sampler), and
        watch ``dataset`` (the user's) for attributes its workers would not see."""
        self._loader = weakref.ref(loader)
        self._dataset = dataset

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
        first = iter(self.sampler) if self.index_sampler else None
        return self._keys(first)

    def _keys(self, first: Iterator[Any] | None) -> Iterator[Any]:
        loader = None if self._loader is None else self._loader()
        base_seed = None
        if loader is not None and compat.live_loader_iterator(loader) is not None:  # a later pass
            # what a fresh iterator draws in _BaseDataLoaderIter.__init__, then its second iter()
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())
            first = None
            self._check_dataset()
        elif loader is not None:  # the workers start now, with a copy of the dataset as it is
            self._started = attribute_ids(self._dataset)
        self.passes += 1
        number = self.passes
        for index in self.sampler if first is None else first:
            yield (EPOCH_KEY, index, number, base_seed)

    def _check_dataset(self) -> None:
        """One warning (rank 0) when an attribute of the dataset was reassigned since the workers started."""
        if self._warned or self._started is None:
            return
        changed = reassigned(self._started, self._dataset)
        if changed and env.rank() == 0:
            self._warned = True
            warnings.warn(
                f"{', '.join(changed[:5])} changed in the main process after the loader's workers started; "
                f"they persist, so they still load with the value they copied. Give the dataset a "
                f"set_epoch(epoch) method (its loaders then restart their workers each epoch), or build the "
                f"loader with persistent_workers=False.",
                SpeedupsWarning,
                stacklevel=_loop_level(),
            )

    def __repr__(self) -> str:
        return f"EpochSeeds({self.sampler!r}, index_sampler={self.index_sampler})"


def _loop_level() -> int:
    """The ``stacklevel`` (seen from :meth:`EpochSeeds._check_dataset`) of the first frame outside torch's
    data loading and this package's: the loop's ``for`` over the loader."""
    frame = inspect.currentframe()
    level = 0  # this function's frame is level 0 here, the caller's level 1 there
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch.", "speedups.data")):
        frame, level = frame.f_back, level + 1
    return max(level, 1)

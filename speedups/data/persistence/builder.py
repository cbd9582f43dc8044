"""Loaders whose workers persist across epochs yet draw, epoch after epoch, what fresh workers draw.

One builder for ``fast_loader``, ``tune_loader`` and ``distributed()`` (:func:`build_loader`), and the
unwrapping of what it wraps (:func:`unwrapped`), for code that reads a loader's sampler or dataset.

How: the loader's sampler is wrapped in an :class:`~speedups.data.persistence.EpochSeeds`, which draws each
later pass's base seed in the main process as a fresh ``DataLoader`` iterator would, and its dataset in a
:class:`~speedups.data.persistence.WorkerReseeding`, which reseeds each worker with it at the pass's
first item and runs ``worker_init_fn`` again. A pass whose live workers no longer hold what fresh ones would
copy (the dataset, ``collate_fn`` or ``worker_init_fn`` changed in the main process since they started, or
changed by the workers themselves) starts fresh workers instead
(:class:`~speedups.data.persistence.WorkerRestarts`). What cannot be matched with live workers gets fresh
workers every epoch: a dataset with ``set_epoch`` (or wrapping one), whose per-epoch state only reaches
workers started after it was set; an ``IterableDataset`` (or a DataPipe), whose items have no index to carry
the seed; a torch whose persistent iterator cannot be swapped for one pass.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.utils.data
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from speedups._helpers import compat
from speedups.data.persistence.epoch_seeds import EpochSeeds
from speedups.data.persistence.worker_reseeding import WorkerReseeding
from speedups.data.persistence.worker_watch import WorkerWatch

__all__ = [
    "EXACT",
    "build_loader",
    "has_per_epoch_state",
    "rebuilt_persistence",
    "reseeds_workers",
    "unwrapped",
]

EXACT = "exact"
"""``persistent_workers=EXACT`` asks :func:`build_loader` for workers that persist and draw what fresh ones
draw, or fresh ones where that cannot be matched."""

L = TypeVar("L", bound=DataLoader)

_DATAPIPES = tuple(
    kind for kind in (getattr(torch.utils.data, "MapDataPipe", None),) if isinstance(kind, type)
)  # torch gives a DataPipe dataset a worker_init_fn of its own: it must reach the loader unwrapped


def has_per_epoch_state(dataset: object, depth: int = 4) -> bool:
    """Whether ``dataset``, or one it wraps (``Subset.dataset``, ``ConcatDataset.datasets``), has set_epoch.

    ``set_epoch`` is the convention (Hugging Face datasets, WebDataset, torchdata, Lightning, Accelerate) of a
    dataset whose samples depend on the epoch; the main process calls it, so persistent workers, which hold
    the copy made when they started, would never see it.
    """
    if callable(getattr(dataset, "set_epoch", None)):
        return True
    if depth == 0:
        return False
    inner = getattr(dataset, "dataset", None)
    if inner is not None and inner is not dataset and has_per_epoch_state(inner, depth - 1):
        return True
    many = getattr(dataset, "datasets", None)
    if isinstance(many, (list, tuple)):
        return any(d is not dataset and has_per_epoch_state(d, depth - 1) for d in many[:64])
    return False


def _exact_possible(dataset: Any, num_workers: int) -> bool:
    """Whether workers of a loader over ``dataset`` can persist and still draw what fresh ones draw."""
    if num_workers <= 0 or isinstance(dataset, (IterableDataset, *_DATAPIPES)):
        return False  # no workers; a stream's items have no index to carry the seed
    return not has_per_epoch_state(dataset)  # its set_epoch state reaches fresh workers only


def build_loader(cls: type[L], dataset: Any, /, **kwargs: Any) -> L:
    """``cls(dataset, **kwargs)``; with ``persistent_workers=EXACT``, workers that persist exactly.

    With ``EXACT`` and workers, over a map-style dataset without ``set_epoch``: the dataset is wrapped in a
    ``WorkerReseeding`` (watching the dataset, ``collate_fn`` and ``worker_init_fn`` through a
    ``WorkerWatch``) and the order in an ``EpochSeeds`` (the user's ``batch_sampler``, else ``sampler``,
    else the ``RandomSampler(dataset, generator=generator)`` or ``SequentialSampler`` that ``DataLoader``
    would build), with ``persistent_workers=True``. Otherwise ``persistent_workers=False``. Any other
    value of ``persistent_workers`` goes to ``cls`` as it is (torch's own semantics).

    Raises:
        What ``cls`` raises for its arguments (e.g. ``ValueError`` for ``sampler=`` with ``shuffle=True``).
    """
    if kwargs.get("persistent_workers") is not EXACT:
        return cls(dataset, **kwargs)
    plain = {**kwargs, "persistent_workers": False}
    if not _exact_possible(dataset, int(kwargs.get("num_workers") or 0)):
        return cls(dataset, **plain)
    kwargs["persistent_workers"] = True
    order: EpochSeeds
    if kwargs.get("batch_sampler") is not None:
        order = kwargs["batch_sampler"] = EpochSeeds(kwargs["batch_sampler"], index_sampler=True)
    else:
        inner = kwargs.get("sampler")
        if inner is None:  # what DataLoader would build, built here so the wrapper goes around it
            shuffled = bool(kwargs.pop("shuffle", False))
            generator = kwargs.get("generator")
            inner = RandomSampler(dataset, generator=generator) if shuffled else SequentialSampler(dataset)
        unbatched = "batch_size" in kwargs and kwargs["batch_size"] is None  # torch reads it directly
        order = kwargs["sampler"] = EpochSeeds(inner, index_sampler=unbatched)
    if not compat.restarts_loader_workers():  # a torch whose live iterator cannot be swapped: fresh workers
        return cls(dataset, **plain)
    watch = WorkerWatch()
    loader = cls(
        WorkerReseeding(dataset, kwargs.get("worker_init_fn"), kwargs.get("collate_fn"), watch), **kwargs
    )
    if not compat.keeps_live_iterator(loader):  # a torch that keeps it elsewhere: fresh workers
        return cls(dataset, **plain)
    order.bind(loader, dataset, watch)
    return loader


def unwrapped(obj: Any) -> Any:
    """The user's sampler, batch sampler or dataset inside what :func:`build_loader` wrapped, else ``obj``."""
    while True:
        if isinstance(obj, EpochSeeds):
            obj = obj.sampler
        elif isinstance(obj, WorkerReseeding):
            obj = obj.dataset
        else:
            return obj


def reseeds_workers(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s workers persist and draw what fresh workers draw (built with ``EXACT``)."""
    return isinstance(loader.dataset, WorkerReseeding)


def rebuilt_persistence(loader: DataLoader[Any]) -> bool | str:
    """``persistent_workers`` for a loader rebuilt from ``loader`` with workers: torch's plain persistent
    workers (True) where ``loader`` has them, else :data:`EXACT`."""
    plain = bool(loader.persistent_workers and loader.num_workers > 0) and not reseeds_workers(loader)
    return True if plain else EXACT

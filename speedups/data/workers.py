"""What DataLoader worker processes need: their seeding, their start method, and a pickling check.

Shared by :func:`~speedups.fast_loader` and :func:`~speedups.tune_loader`. Under the ``spawn`` and
``forkserver`` start methods (the default on macOS, Windows and Python 3.14) what a worker needs is
test-pickled before any worker starts, so a lambda ``collate_fn`` fails early with a message that names it.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import pickle
import random
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, get_worker_info

__all__ = [
    "PICKLING_START_METHODS",
    "dataloader_parameters",
    "seed_worker",
    "start_method",
    "unpicklable_for_workers",
]

# Start methods that send the dataset, collate_fn and worker_init_fn to each worker by pickling them.
PICKLING_START_METHODS = ("spawn", "forkserver")


def seed_worker(worker_id: int, init_fn: Callable[[int], object] | None = None) -> None:
    """Seed ``numpy`` and ``random`` in a DataLoader worker from torch's worker seed, then call ``init_fn``.

    torch gives each worker ``base_seed + worker_id`` as its torch seed (``get_worker_info().seed``), where
    ``base_seed`` is drawn from the loader's ``generator`` (or the global torch RNG) each time an epoch's
    workers start. Deriving the other two streams from it makes them distinct across workers and epochs and
    reproducible from the generator's seed. Module-level (not a closure) so it pickles under ``spawn``.
    """
    info = get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed()
    random.seed(f"speedups-worker-{seed}")  # str seeds go through SHA-512: stable across runs
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(np.random.SeedSequence(seed).generate_state(4))
    if init_fn is not None:
        init_fn(worker_id)


def start_method(context: object) -> str:
    """The start method workers will use: the loader's context, else the process default (nothing is set)."""
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())  # type: ignore[attr-defined]
    # get_start_method() without allow_none would fix the default for the whole process: never call it.
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


class _Discard:
    """A file that drops what is written: pickling into it checks picklability without holding the bytes."""

    def write(self, data: bytes) -> int:
        return len(data)


def unpicklable_for_workers(
    method: str, dataset: object, collate_fn: object, worker_init_fn: object
) -> tuple[str, object, Exception] | None:
    """What workers started with ``method`` would fail to unpickle: ``(name, object, error)``, or None.

    Only ``spawn`` and ``forkserver`` pickle the dataset, ``collate_fn`` and ``worker_init_fn``; under
    ``fork`` this returns None without pickling anything. The bytes go to a sink that keeps none, so a large
    in-memory dataset costs about one worker start.
    """
    if method not in PICKLING_START_METHODS:
        return None
    for name, obj in (("dataset", dataset), ("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if obj is None:
            continue
        try:
            pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as err:
            return name, obj, err
    return None


@functools.cache
def dataloader_parameters() -> frozenset[str]:
    """The argument names this torch's ``DataLoader`` takes."""
    return frozenset(inspect.signature(DataLoader.__init__).parameters)

"""The worker side of persistent workers that draw what fresh ones draw: each pass's first item reseeds.

torch's persistent workers are seeded once, when they start; fresh workers (``persistent_workers=False``)
are seeded at every epoch from a base seed the main process draws. :class:`WorkerReseeding` wraps the
dataset so that a worker kept alive reseeds itself, as a fresh worker would have been seeded, when the first
key of a new pass reaches it; the key carries that pass's base seed from the main process
(:class:`~speedups.data.persistence.epoch_seeds.EpochSeeds`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils.data import get_worker_info

from speedups._helpers import compat
from speedups._helpers.rng import numpy_or_none
from speedups.data.read_through import ReadThrough

__all__ = ["EPOCH_KEY", "WorkerReseeding", "is_epoch_key"]

EPOCH_KEY = "speedups.epoch_key"
"""The first element of a key ``(EPOCH_KEY, index, pass, base_seed)``: it tells a key from an index."""


def is_epoch_key(key: Any) -> bool:
    """Whether ``key`` is one :class:`~speedups.data.persistence.epoch_seeds.EpochSeeds` handed out."""
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

    Every attribute but ``dataset`` and ``worker_init_fn`` is read from, written to and deleted from the
    wrapped dataset (``loader.dataset.classes``, ``get_worker_info().dataset.start = 0``);
    ``isinstance(loader.dataset, MyDataset)`` is False: use ``loader.dataset.dataset``. Pickles (spawn)
    when the dataset and ``worker_init_fn`` do.

    Args:
        dataset: a map-style dataset.
        worker_init_fn: the loader's ``worker_init_fn`` (None: none), called again at each new pass.
    """

    _OWN: ClassVar[frozenset[str]] = frozenset({"dataset", "worker_init_fn", "_pass"})
    _pass: int | None

    def __init__(self, dataset: Any, worker_init_fn: Callable[[int], object] | None = None) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "worker_init_fn", worker_init_fn)
        object.__setattr__(self, "_pass", None)  # the pass this (worker's copy of the) dataset last loaded

    def __getitems__(self, keys: Any) -> list[Any]:
        """Load a batch: a batch key, a list of keys (of one pass), or plain indices."""
        if is_epoch_key(keys):  # a batch sampler's batch, as it made it
            self._enter(keys)
            indices = keys[1]
        elif isinstance(keys, list) and keys and is_epoch_key(keys[0]):
            self._enter(keys[0])  # the keys of a batch share their pass
            indices = [key[1] for key in keys]
        else:
            indices = keys
        own = getattr(self.dataset, "__getitems__", None)
        if own:  # what torch's fetcher checks
            return own(indices)
        return [self.dataset[index] for index in indices]

    def __getitem__(self, key: Any) -> Any:
        if not is_epoch_key(key):
            return self.dataset[key]
        self._enter(key)
        return self.dataset[key[1]]

    def _enter(self, key: tuple[str, Any, int, int | None]) -> None:
        """At the first key of a new pass, reseed this worker as torch seeds a fresh one."""
        _, _, number, base_seed = key
        if number == self._pass:
            return
        self._pass = number
        info = get_worker_info()
        if base_seed is None or info is None:  # the first pass (torch seeded the workers) or no worker
            return
        seed = base_seed + info.id
        random.seed(seed)
        torch.manual_seed(seed)
        np = numpy_or_none()
        if np is not None:
            np.random.seed(compat.worker_numpy_seed(base_seed, info.id))
        compat.set_worker_seed(info, seed)
        if self.worker_init_fn is not None:
            self.worker_init_fn(info.id)

    def __repr__(self) -> str:
        return f"WorkerReseeding({self.dataset!r})"

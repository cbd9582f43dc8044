"""What a persistent worker tells the main process: its copy of the dataset changed, so it is no fresh one.

A fresh ``DataLoader`` worker starts each epoch from the main process's copy of the dataset (and its
``collate_fn`` and ``worker_init_fn``). A worker kept alive holds on to its own copy, and whatever changed it
there lives on: a ``worker_init_fn`` that adjusts the copy (run again each epoch, it compounds), a generator
the dataset owns advancing as ``__getitem__`` draws from it, an attribute ``__getitem__`` sets. A
:class:`WorkerWatch` records each worker's copy as it starts (before ``worker_init_fn``), compares it after
``worker_init_fn`` and after each batch, and flags a change in memory shared with the main process, which
reads it before the next epoch starts and starts fresh workers instead (:class:`~speedups.data.persistence.
worker_restarts.WorkerRestarts`).
"""

from __future__ import annotations

from typing import Any

import torch

from speedups.data.persistence.fingerprint import WORKER, Fingerprint

__all__ = ["WorkerWatch"]

_PATH_BYTES = 120


class WorkerWatch:
    """A flag shared by a loader's main process and workers: which change, where, made a worker's copy drift.

    Made in the main process before any worker starts; workers get it with the dataset wrapper (inherited by
    ``fork``, shared through torch's ``spawn``/``forkserver`` pickling: a tensor in shared memory, one
    byte for the cause and the changed path, for the warning). Once set it stays set: a copy that changed
    itself once will in every epoch's fresh worker too.

    Worker side: :meth:`start` (as the worker starts, before ``worker_init_fn``), then :meth:`check` after
    ``worker_init_fn`` and after each batch, until it is set (about as long as a :class:`~speedups.data.
    persistence.fingerprint.Fingerprint` of the watched objects: a few µs for tensors in memory). Main side:
    :meth:`drift`.
    """

    INIT = 1
    """Cause: ``worker_init_fn`` changed the worker's copy."""
    LOADING = 2
    """Cause: the copy changed while the worker loaded a batch (``__getitem__``, ``__getitems__``,
    ``collate_fn``)."""

    def __init__(self) -> None:
        self._shared = torch.zeros(1 + _PATH_BYTES, dtype=torch.uint8).share_memory_()
        self._view: Any = None  # a numpy view of it, made where it is first read (not pickled)
        self._start: Fingerprint | None = None  # a worker's copy as it started (worker side only)

    def __getstate__(self) -> dict[str, Any]:
        return {"_shared": self._shared, "_view": None, "_start": None}

    def _flags(self) -> Any:
        if self._view is None:
            self._view = self._shared.numpy()
        return self._view

    def start(self, watched: dict[str, Any]) -> None:
        """Record the worker's copy of ``watched`` as it is, before ``worker_init_fn`` runs (worker side)."""
        self._start = Fingerprint(watched, WORKER)

    def check(self, watched: dict[str, Any], cause: int) -> None:
        """Set the flag if ``watched`` differs from what :meth:`start` recorded (worker side).

        A handle opened lazily (an attribute that was None, or absent, now holding an object of no watched
        kind: an h5py file, an LMDB environment) does not count, as a fresh worker would open it again to the
        same effect; the object is watched from then on.
        """
        flags = self._flags()
        if self._start is None or flags[0]:  # no worker start seen here, or already set: nothing to add
            return
        now = Fingerprint(watched, WORKER)
        changed = now.changed(self._start)
        if not changed:
            return
        if now.opened_lazily(self._start, changed):
            self._start = now
            return
        path = changed[0].encode()[:_PATH_BYTES]
        flags[1 : 1 + len(path)] = list(path)
        flags[0] = cause  # last: the main process reads the path once the cause is there

    def drift(self) -> tuple[int, str] | None:
        """``(cause, path)`` of the first change a worker flagged, or None (main side)."""
        flags = self._flags()
        cause = int(flags[0])
        if not cause:
            return None
        return cause, bytes(flags[1:]).rstrip(b"\0").decode(errors="replace")

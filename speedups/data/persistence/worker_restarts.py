"""When a pass of persistent workers must start fresh workers instead, to yield what fresh workers yield.

A fresh ``DataLoader`` iterator copies the dataset (with ``collate_fn`` and ``worker_init_fn``) into new
workers at every epoch; workers kept alive hold the copy they made. They still yield what fresh ones would as
long as both copies are alike: nothing changed in the main process since they started, and nothing changed
in theirs. :class:`WorkerRestarts` tells, at each later pass, whether that holds, and when it does not,
replaces the live workers by fresh ones for that pass, which copy the dataset and draw their base seed as a
fresh iterator does: exact by construction.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from speedups._helpers import compat, env
from speedups.data.persistence.fingerprint import MAIN, Fingerprint
from speedups.data.persistence.worker_watch import WorkerWatch
from speedups.errors import SpeedupsWarning

__all__ = ["WorkerRestarts"]


class WorkerRestarts:
    """The main process's side of persistent workers that restart where their copies differ from fresh ones'.

    :meth:`started` records the watched objects (a :class:`~speedups.data.persistence.fingerprint.
    Fingerprint`: attributes reassigned, tensors changed in place, generators advanced, containers and
    arrays changed) when a pass's workers start. At a later pass :meth:`reason` compares them again (once
    per epoch: about 10 µs for a tensor dataset, 1 ms for 50,000 labels in a list) and reads the
    :class:`~speedups.data.persistence.worker_watch.WorkerWatch` the workers set when their own copy changed
    (in ``worker_init_fn``, or as they loaded). A change in the main process restarts the workers for the
    next pass only (they then persist again); a change in the workers restarts them at every later pass,
    since each fresh worker would change its copy again. :meth:`restart` swaps the workers (one
    :class:`~speedups.SpeedupsWarning` per loader, rank 0, at the first). A CPU tensor in shared memory is
    compared without its version counter: the workers share its changes, as fresh ones would.

    Attributes:
        restarts: how many passes started fresh workers in place of the live ones.
    """

    def __init__(self, watch: WorkerWatch) -> None:
        self._watch = watch
        self._started: Fingerprint | None = None
        self._always: str | None = None  # why every pass restarts, once the workers changed their copies
        self._warned = False
        self.restarts = 0

    def started(self, watched: dict[str, Any]) -> None:
        """Record ``watched`` as the workers starting now copy it (they start in this pass)."""
        if self._always is None:
            self._started = Fingerprint(watched, MAIN)

    def reason(self, watched: dict[str, Any]) -> str | None:
        """Why the live workers cannot serve the next pass as fresh ones would, or None if they can."""
        if self._always is not None:
            return self._always
        drift = self._watch.drift()
        if drift is not None:
            cause, path = drift
            where = "in worker_init_fn" if cause == WorkerWatch.INIT else "as it loaded"
            self._always = f"{path} changed in a worker {where}"
            return self._always
        if self._started is None:
            return None
        changed = Fingerprint(watched, MAIN).changed(self._started)
        if not changed:
            return None
        shown = ", ".join(_outermost(changed)[:3])
        return f"{shown} changed in the main process after the workers started"

    def restart(self, loader: Any, reason: str, watched: dict[str, Any]) -> None:
        """Replace ``loader``'s live workers by fresh ones for this pass (see
        :func:`~speedups._helpers.compat.restart_loader_workers`), warning once why."""
        if not self._warned and env.rank() == 0:
            self._warned = True
            warnings.warn(_message(reason, self._always is not None, watched), SpeedupsWarning, _loop_level())
        self.restarts += 1
        compat.restart_loader_workers(loader)


def _outermost(paths: list[str]) -> list[str]:
    """The changed paths that lie under no other changed one (``dataset.aug``, not also ``dataset.aug.p``)."""
    return [p for p in paths if not any(p != q and p.startswith((q + ".", q + "[")) for q in paths)]


def _message(reason: str, always: bool, watched: dict[str, Any]) -> str:
    """The one warning: what changed, what the loader does about it, and how to keep the workers."""
    first = reason.split(",")[0].split(" ")[0]
    if always:
        what = (
            f"{reason} (a fresh worker starts each epoch from the main process's copy; a persistent one "
            f"keeps its own). So every epoch from the next on starts fresh workers"
        )
        fix = (
            "leave the worker's copy as it was: draw from the generators the loader reseeds every epoch "
            "(torch.rand(...), np.random.rand(), random.random()) rather than one the dataset owns, and keep "
            "worker_init_fn from changing the dataset"
        )
    else:
        what = (
            f"{reason}, and the workers persist with the copy they made. So this epoch, and each later one "
            f"whose dataset changed, starts fresh workers that copy it"
        )
        fix = "change the dataset only before the first epoch"
        if isinstance(_value_at(watched, first), torch.Tensor):
            fix = f"put the tensor in shared memory, where they see it, before the first epoch: {first}"
            fix += ".share_memory_()"
    return (
        f"for batch in loader: {what}, as DataLoader(persistent_workers=False) does (a worker start-up each; "
        f"the workers of fast_loader and distributed() persist by default). To keep the workers alive, {fix}."
    )


def _value_at(watched: dict[str, Any], path: str) -> Any:
    """The object at a plain attribute path (``dataset.labels``) of ``watched``, or None."""
    root, *names = path.split(".")
    value = watched.get(root)
    for name in names:
        if "[" in name:
            return None
        value = getattr(value, "__dict__", {}).get(name)
    return value


def _loop_level() -> int:
    """The ``stacklevel`` (seen from :meth:`WorkerRestarts.restart`) of the first frame outside torch's data
    loading and this package's: the loop's ``for`` over the loader."""
    frame = inspect.currentframe()
    level = 0  # this function's frame is level 0 here, the caller's level 1 there
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch.", "speedups.data")):
        frame, level = frame.f_back, level + 1
    return max(level, 1)

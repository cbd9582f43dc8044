"""How the gradients of an accumulation window reach every rank: one process, DDP, or FSDP2.

``@accumulate`` picks one strategy when it decorates (:func:`~.choice.grad_sync_for`) and calls it on the
hot path, so the accumulator holds no data-parallel branch of its own. A strategy says, per micro-step,
which context the forward and backward run in (:meth:`GradSync.micro_step`), how a micro-step's loss is
weighed by its item count (:meth:`GradSync.reference`, :meth:`GradSync.weigh`), how the item count is
all-reduced (:meth:`GradSync.reduce_count`), and how a flushed short window whose calls never synchronised
is reduced (:meth:`GradSync.sync_window`). DDP and FSDP2 average the gradients over the world size when
they sync; ``world`` tells the accumulator by how much.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NULL_CONTEXT", "DataParallelSync", "GradSync", "LocalCount", "SyncKind", "count_dtype"]

LocalCount = Callable[[torch.device], torch.Tensor] | None
"""How a flushed window's item count is made on a device (None: the window counts no items)."""

NULL_CONTEXT = contextlib.nullcontext()


class SyncKind(enum.Enum):
    """Which gradient synchronisation a step runs under."""

    SINGLE = "single"
    DDP = "ddp"
    FSDP2 = "fsdp2"


def count_dtype(device: torch.device) -> torch.dtype:
    """The dtype item counts are summed in on ``device``: float64, or float32 where there is none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


class GradSync:
    """One process: nothing to synchronise. The base of the data-parallel strategies.

    Attributes:
        kind: the :class:`SyncKind`.
        world: the number of ranks the gradient sync averages over (1 here).
        group: the process group of the item-count all-reduce (None: the default one).
    """

    kind = SyncKind.SINGLE
    flush_averaged = False
    """Whether a flushed window's gradients are averaged over the ranks (FSDP2 synced it) or summed."""
    boundary_flushes = False
    """Whether the open window's boundary call is reduced as a flush is: its backward without sync, then
    :meth:`sync_window` (DDP, for a window whose gradients its reducer did not see made)."""

    def __init__(self, world: int = 1, group: Any = None) -> None:
        self.world = world
        self.group = group
        self.zeroed: set[int] = set()  # ids of parameters this strategy gave a zero gradient (DDP, a flush)

    def check_window(self, every: int, micro_batches: bool) -> None:
        """Refuse, at decoration, a window of ``every`` calls (split into micro-batches or not) this strategy
        cannot run; every window is fine here."""

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        """Return the context a micro-step's forward and backward run in (``boundary``: it ends a window)."""
        return NULL_CONTEXT

    def piece_step(self, boundary: bool, last: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch of a split call runs in (``last``: the call's last micro-batch)."""
        return NULL_CONTEXT

    def split_call_starts(self, syncs: bool) -> None:
        """A call split into micro-batches starts, before its first micro-batch (``syncs``: it ends a window
        or an epoch pass; :meth:`micro_step` is the unsplit call's start); nothing to do here."""

    def retry_allowed(self, backwards: int) -> bool:
        """Whether a split call that ran out of memory after ``backwards`` micro-batch backwards may run
        again at a smaller size on this rank alone (its gradients put back as they were)."""
        return True

    def reference(self, n: Any) -> Any:
        """The weight reference of a window whose first item count is ``n`` (a number or a 0-dim tensor).

        One process weighs each backward by ``n / reference``, so that its magnitude (and an fp16 scaler's
        headroom) does not grow with the count; the boundary undoes it exactly.
        """
        if isinstance(n, torch.Tensor):
            return n.detach().reshape(()).to(count_dtype(n.device)).clamp_min(1.0)
        return max(float(n), 1.0)

    def weigh(self, loss: torch.Tensor, n: Any, reference: Any) -> torch.Tensor:
        """The tensor backward runs on for a micro-step of ``n`` items (before loss scaling)."""
        return loss * (n / reference)

    def reduce_count(self, count: torch.Tensor) -> Any:
        """Launch the sum of the window's item ``count`` over the ranks, in place; return the work handle.

        Called at the boundary, before backward, only when ``world > 1``.
        """
        return dist.all_reduce(count, group=self.group, async_op=True)

    def sync_window(
        self, params: Sequence[torch.Tensor], local_count: LocalCount, pending: int, every: int
    ) -> torch.Tensor | None:
        """Synchronise a flushed window of ``pending`` calls that never synchronised (every rank calls it).

        Returns the global item count (``local_count(device)`` summed over the ranks), or None when there is
        nothing to sum (no ``local_count``, or one process).
        """
        return None

    def before_update(self, params: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Called at a boundary, after the gradients were synchronised and before the optimizer update.

        ``params()`` gives the step's parameters (called only when needed: nothing to do costs nothing).
        """

    def after_flush(self, params: Sequence[torch.Tensor]) -> None:
        """Called after the update of a flushed window (every rank calls it)."""

    def check_discard(self, pending: int, every: int) -> None:
        """Refuse, before anything changes, to drop an open window of ``pending`` calls whose gradients this
        strategy cannot drop; every window can be dropped here."""

    def restart(self, pending: int = 0) -> None:
        """After a checkpoint is loaded, with ``pending`` calls of a window restored: forget any switched-off
        sync (the next window starts afresh)."""


class DataParallelSync(GradSync):
    """Several ranks: every rank must weigh alike, so a micro-step's weight is its item count itself."""

    def __init__(self, model: Any, world: int, group: Any = None) -> None:
        super().__init__(world, group)
        self.model = model

    def reference(self, n: Any) -> Any:
        return 1.0

    def weigh(self, loss: torch.Tensor, n: Any, reference: Any) -> torch.Tensor:
        return loss * n

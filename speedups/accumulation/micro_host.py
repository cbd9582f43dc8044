"""What the micro-batcher uses of the ``@accumulate`` step it serves: the :class:`MicroHost`.

A call split into micro-batches (:mod:`.micro_batching`) runs forward and backward once per piece; the
batcher reaches the step only through this small interface (parse a result, weigh and run one backward,
the context a piece runs in, save and restore the window's item counts, drop the window), so the step's
objects keep their state to themselves.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from speedups.accumulation.checks import check_outer_autocast, refuse_freed_graph
from speedups.accumulation.epoch_pass import EpochPass
from speedups.accumulation.grad_sync import GradSync
from speedups.accumulation.guard import Guard
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.update import Update
from speedups.accumulation.window import Window
from speedups.accumulation.zero_items import Keep

__all__ = ["MicroHost"]


class _Step(Protocol):
    step: int
    pending: int
    is_boundary: bool
    sync: GradSync
    window: Window
    params: StepParameters
    updater: Update
    guard: Guard
    passes: EpochPass

    def drop_window(self) -> int: ...


class MicroHost:
    """The step as a ``MicroBatchHost`` (see :mod:`~speedups.accumulation.micro_batching.batcher`)."""

    def __init__(self, step: _Step) -> None:
        self.step = step

    def parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        """Check a micro-batch's result; return ``(loss, num_items)`` (see ``Window.parse``)."""
        return self.step.window.parse(out)

    def backward_micro(self, loss: torch.Tensor, n: Any, weight: float, *, first_piece: bool) -> Keep:
        """Weigh and run one micro-batch's backward; return which of its gradients count (see ``keep_of``).

        ``weight``: the micro-batch's share of the call's rows (a mean loss); ``first_piece``: the call's
        first micro-batch (with an empty window, its item count is the window's weight reference).
        """
        step, window = self.step, self.step.window
        keep: Keep = None
        if first_piece and step.pending == 0:
            step.guard.first_call()
        if n is None:
            target, scale = loss, weight * window.inv_every
        else:
            (target, keep), scale = window.weigh_items(loss, n, first=step.pending == 0 and first_piece), 1.0
        if step.updater.scaler is None:
            check_outer_autocast(loss.device.type)
        try:
            window.backward(target, keep, scale, step.updater.scaler)
        except RuntimeError as err:
            refuse_freed_graph(err, step.step)
            raise
        return keep

    def piece_context(self, last: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch runs in: gradient sync only where its strategy needs it (FSDP2: the
        last micro-batch of a boundary call; DDP: never, the boundary call reduces once after them)."""
        step = self.step
        return step.sync.piece_step(step.is_boundary or step.passes.closes, last)

    def retry_allowed(self, backwards: int) -> bool:
        """Whether a call that ran out of memory may run again at a smaller size (see ``GradSync``)."""
        return self.step.sync.retry_allowed(backwards)

    def trainable(self) -> list[torch.Tensor]:
        """The optimizers' parameters, in optimizer then param-group order."""
        return self.step.params.all()

    def window_counts(self) -> tuple[float, torch.Tensor | None, Any]:
        """The open window's item counts and weight reference."""
        return self.step.window.counts()

    def restore_counts(self, snapshot: tuple[float, torch.Tensor | None, Any]) -> None:
        """Put back what :meth:`window_counts` returned."""
        self.step.window.restore_counts(snapshot)

    def drop_window(self) -> int:
        """Close the window without an update (gradients to None); return the calls dropped with this one."""
        return self.step.drop_window()

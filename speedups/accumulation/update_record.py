"""What a step hands to its ``on_update`` hooks after each optimizer step it really took."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["UpdateRecord"]

_UNREAD = object()


class UpdateRecord:
    """One optimizer step of an ``@accumulate`` step, as its ``on_update`` hooks receive it. No field syncs.

    Made on every update a hook sees, so it is a slotted class (cheaper to build than a dataclass) and the
    window's mean loss is computed only when read.

    Attributes:
        step: micro-steps (calls) so far, this window's included.
        num_updates: optimizer steps really taken, this one included (1 for the first).
        micro_steps: calls in the window this update applied (fewer than ``every`` for a flushed window).
        num_items: the window's item count (all ranks), a number or a 0-dim device tensor; None for a bare
            mean loss.
        grad_norm: the total 2-norm of the window's mean gradient before clipping, a 0-dim device tensor
            (summed in ``model.parameters()`` order when ``model=`` was given); None when the step computed
            none (it does with ``max_grad_norm``, an fp16 GradScaler or ``skip_nonfinite``).
        lrs: a list of the learning rate of every param group of every optimizer, as used by this step
            (read before the schedulers stepped), in optimizer then param-group order.
        loss: this rank's mean loss over the window (see the property); :meth:`loss_totals` gives its sum
            and count, which summed over the ranks give the job's mean.
    """

    __slots__ = (
        "_loss", "_parts", "_weighted", "grad_norm", "lrs", "micro_steps", "num_items", "num_updates", "step",
    )  # fmt: skip

    def __init__(
        self,
        step: int,
        num_updates: int,
        micro_steps: int,
        num_items: Any,
        grad_norm: torch.Tensor | None,
        lrs: list[Any],
        parts: list[tuple[torch.Tensor, Any]],
        weighted: bool,
    ) -> None:
        self.step = step
        self.num_updates = num_updates
        self.micro_steps = micro_steps
        self.num_items = num_items
        self.grad_norm = grad_norm
        self.lrs = lrs
        self._parts = parts
        self._weighted = weighted
        self._loss: Any = _UNREAD

    def __repr__(self) -> str:
        return (
            f"UpdateRecord(step={self.step}, num_updates={self.num_updates}, micro_steps={self.micro_steps}, "
            f"num_items={self.num_items!r}, grad_norm={self.grad_norm!r}, lrs={self.lrs!r})"
        )

    @property
    def loss(self) -> torch.Tensor | None:
        """This rank's mean loss over the window: a detached 0-dim device tensor, made when first read (a few
        device ops, no sync). Weighted by the item counts when the step returns ``(loss, num_items)`` (NaN
        for a window of no items); None when the window began before the first hook was registered."""
        if self._loss is _UNREAD:
            self._loss = self._mean()
        return self._loss

    def loss_totals(self) -> torch.Tensor | None:
        """This rank's window loss as ``(sum, count)``: a detached float64 tensor of shape ``(2,)`` on the
        loss's device (float32 on MPS), made with a few device ops and no sync.

        ``sum / count`` is :attr:`loss`. For a bare mean loss: the sum of the calls' losses and the number
        of calls; with ``(loss, num_items)``: the items' summed loss and the number of items. Summed over
        the ranks (one all-reduce), ``sum / count`` is the job's mean: what one process would log with the
        same global batch. None when :attr:`loss` is None.
        """
        sums = self._sums()
        if sums is None:
            return None
        total, count = sums
        total = total.detach().reshape(())
        dtype = torch.float32 if total.device.type == "mps" else torch.float64
        total = total.to(dtype)
        if not self._weighted:
            return torch.stack([total, torch.full_like(total, count)])
        if isinstance(count, torch.Tensor):  # on the loss's device: a copy from another device, no wait
            count = count.detach().reshape(()).to(total.device, dtype, non_blocking=True)
            return torch.stack([total, count])
        return torch.stack([total, torch.full_like(total, float(count))])  # a fill: no host-device copy

    def _sums(self) -> tuple[torch.Tensor, Any] | None:
        """The window's summed loss (times items) and its count (calls, or items), or None (no loss)."""
        parts = self._parts
        if len(parts) != self.micro_steps or not parts:
            return None
        total = parts[0][0]
        for part, _ in parts[1:]:
            total = total + part
        if not self._weighted:
            return total, len(parts)
        count: Any = 0
        for _, n in parts:
            count = count + n
        return total, count

    def _mean(self) -> torch.Tensor | None:
        sums = self._sums()
        if sums is None:
            return None
        total, count = sums
        if not self._weighted:
            return total / count
        if isinstance(count, torch.Tensor):
            return torch.where(count > 0, total / count, math.nan).to(total.dtype)
        return total / count if count else torch.full_like(total, math.nan)

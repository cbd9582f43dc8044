"""What a step hands to its ``on_update`` hooks after each optimizer step it really took."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["UpdateRecord"]


@dataclass(frozen=True)
class UpdateRecord:
    """One optimizer step of an ``@accumulate`` step, as its ``on_update`` hooks receive it. No field syncs.

    Attributes:
        step: micro-steps (calls) so far, this window's included.
        num_updates: optimizer steps really taken, this one included (1 for the first).
        micro_steps: calls in the window this update applied (fewer than ``every`` for a flushed window).
        loss: this rank's mean loss over the window, a detached 0-dim device tensor (weighted by the item
            counts when the step returns ``(loss, num_items)``); None when the window began before the first
            hook was registered.
        num_items: the window's item count (all ranks), a number or a 0-dim device tensor; None for a bare
            mean loss.
        grad_norm: the total 2-norm of the window's mean gradient before clipping, a 0-dim device tensor
            (summed in ``model.parameters()`` order when ``model=`` was given); None when the step computed
            none (it does with ``max_grad_norm``, an fp16 GradScaler or ``skip_nonfinite``).
        lrs: the learning rate of every param group of every optimizer, as used by this step (read before
            the schedulers stepped), in optimizer then param-group order.
    """

    step: int
    num_updates: int
    micro_steps: int
    loss: torch.Tensor | None
    num_items: Any
    grad_norm: torch.Tensor | None
    lrs: tuple[Any, ...]

"""What a training step (``@accumulate``) and ``mixed_precision`` share: the current step, and the update.

``@accumulate`` sets :data:`current_step` while it runs the user's function; a ``mixed_precision`` context
entered during that call hands its ``GradScaler`` to the step through :meth:`ScalerSink.adopt_scaler`, so
both spellings (stacked decorators, or ``with mixed_precision("fp16"):`` inside the step) use one mechanism,
without inspecting decorator chains. :func:`apply_update` is the one optimizer update both of them run:
unscale once, normalise, clip, step or skip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Protocol

import torch

from speedups._helpers import validate

__all__ = [
    "ScalerSink",
    "apply_update",
    "check_max_grad_norm",
    "current_step",
    "grads_of",
    "total_norm",
]


class ScalerSink(Protocol):
    """A training step that can take over the loss scaling of a ``mixed_precision`` context."""

    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        """Take ``scaler`` (or keep the one already adopted) and return the scaler the step will use."""
        ...


current_step: ContextVar[ScalerSink | None] = ContextVar("speedups_current_step", default=None)


def check_max_grad_norm(max_grad_norm: object) -> float | None:
    """Validate a clipping norm (``max_grad_norm=`` of ``@accumulate`` and ``mixed_precision.step``).

    Returns it as a float, or None (no clipping). Callers put the call as written in front of the message
    (``validate.arguments``).

    Raises:
        TypeError: not a real number or None.
        ValueError: not a positive finite number.
    """
    return validate.real(max_grad_norm, "max_grad_norm", positive=True, none_ok=True, example="1.0")


def grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The existing gradients of the optimizer's parameters, in param-group order."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all ``grads`` as a 0-dim tensor (no sync); 0 when there are none."""
    if not grads:
        return torch.zeros(())
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads)
    norms = [torch.linalg.vector_norm(g.detach()).to(grads[0].device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def apply_update(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    factor: float | torch.Tensor,
    *,
    skip_nonfinite: bool,
    probe: torch.Tensor | None = None,
) -> tuple[bool, torch.Tensor | None]:
    """Unscale once, multiply the gradients by ``factor``, clip, then step the optimizer or skip.

    With a ``scaler``, ``GradScaler.step`` decides (it skips a step whose gradients hold inf/NaN, which is its
    own host-device sync) and ``GradScaler.update`` runs. Without one and with ``skip_nonfinite``, the step is
    skipped when ``probe`` (a tensor that is non-finite exactly when the step must not happen), or else the
    gradient norm, is not finite: reading that is one host-device sync.

    Returns:
        ``(stepped, probe)``: whether ``optimizer.step`` really ran (a Python bool), and the 0-dim tensor
        whose finiteness was checked (the gradient norm when there was one), or None when nothing was checked.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    if not isinstance(factor, float) or factor != 1.0:
        for g in grads_of(optimizer):
            g.mul_(factor)
    if max_grad_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        probe = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    elif scaler is not None or (skip_nonfinite and probe is None):
        probe = total_norm(grads_of(optimizer))
    if scaler is None:
        if skip_nonfinite and probe is not None and not math.isfinite(probe.item()):  # host-device sync
            return False, probe
        optimizer.step()
        return True, probe
    stepped: list[bool] = []
    handle = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    try:
        scaler.step(optimizer)  # GradScaler's own sync: skips the step on inf/NaN
    finally:
        handle.remove()
    scaler.update()
    return bool(stepped), probe

"""What a training step (``@accumulate``) and ``mixed_precision`` share: the current step, and the update.

``@accumulate`` sets :data:`current_step` while it runs the user's function; a ``mixed_precision`` context
entered during that call hands its ``GradScaler`` to the step through :meth:`ScalerSink.adopt_scaler`, so
both spellings (stacked decorators, or ``with mixed_precision("fp16"):`` inside the step) use one mechanism,
without inspecting decorator chains. :func:`apply_update` is the one optimizer update both of them run:
unscale once, normalise, clip, step or skip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Protocol

import torch

from speedups._helpers import validate

__all__ = [
    "ScalerSink",
    "apply_update",
    "check_clipping",
    "check_max_grad_norm",
    "current_step",
    "grads_of",
    "params_of",
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


def check_clipping(max_grad_norm: object, max_grad_value: object) -> tuple[float | None, float | None]:
    """Validate the two ways to clip (``max_grad_norm=``, ``max_grad_value=``): each a positive finite number
    or None, and not both. Callers put the call as written in front of the message.

    Raises:
        TypeError: not a real number or None.
        ValueError: not a positive finite number; both given.
    """
    norm = check_max_grad_norm(max_grad_norm)
    value = validate.real(max_grad_value, "max_grad_value", positive=True, none_ok=True, example="0.5")
    if norm is not None and value is not None:
        raise ValueError(
            f"max_grad_norm={norm!r}, max_grad_value={value!r}: these are two ways to clip; give one. Clip "
            f"the total norm (max_grad_norm=1.0, the usual choice) or each element (max_grad_value=0.5); for "
            f"both, clip by value yourself in train_step.before_update(fn)."
        )
    return norm, value


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The existing gradients of ``params``, in their order."""
    return [p.grad for p in params if p.grad is not None]


def params_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The distinct parameters of ``optimizers``, in optimizer then param-group order."""
    seen: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


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
    optimizers: Sequence[torch.optim.Optimizer],
    scaler: torch.amp.GradScaler | None,
    max_grad_norm: float | None,
    factor: float | torch.Tensor,
    *,
    skip_nonfinite: bool,
    params: Callable[[], Sequence[torch.Tensor]],
    probe: torch.Tensor | None = None,
    max_grad_value: float | None = None,
    before_step: Callable[[], object] | None = None,
) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
    """Unscale once per optimizer, multiply the gradients by ``factor``, clip, then step them all or none.

    ``params()`` gives the parameters of ``optimizers`` in the order the gradient norm sums them (called only
    when the gradients are touched: the cost of a plain update stays the optimizer's; the model's order when
    known: ``clip_grad_norm_(model.parameters())`` gives the same norm bit for bit). With a
    ``scaler`` the gradients are unscaled (``GradScaler.unscale_`` per optimizer) and the norm decides: if it
    is not finite no optimizer steps (one window, one decision, also for fused optimizers, whose own skip
    GradScaler cannot report), and ``GradScaler.update`` backs the scale off. Without a scaler and with
    ``skip_nonfinite``, ``probe`` (non-finite exactly when the step must not happen), else the norm, decides.
    Reading the decision is one host-device sync; without a scaler or ``skip_nonfinite`` there is none.
    ``max_grad_value`` clamps every gradient element to ``[-v, v]`` after that decision (an fp16 overflow
    still skips, as ``GradScaler.step`` skips after ``unscale_`` and ``clip_grad_value_``); ``before_step()``
    runs last, on the final gradients, only when the optimizers will step.

    Returns:
        ``(stepped, grad_norm, checked)``: whether the optimizers stepped (a Python bool); the total gradient
        norm before clipping (a 0-dim device tensor) when one was computed (clipping, a scaler, or
        ``skip_nonfinite`` without ``probe``), else None; the 0-dim tensor whose finiteness was checked (the
        norm, else ``probe``), or None when nothing was.

    Raises:
        whatever a step of the optimizers or ``before_step`` raises; the scaler is ready for the next update
        then (``unscale_`` again would raise forever), its scale kept.
    """
    try:  # free when nothing raises
        if scaler is not None:
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
        if not isinstance(factor, float) or factor != 1.0:
            for g in grads_of(params()):
                g.mul_(factor)
        norm: torch.Tensor | None = None
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in params() if p.grad is not None], max_grad_norm)
        elif scaler is not None or (skip_nonfinite and probe is None):
            norm = total_norm(grads_of(params()))
        decider = norm if norm is not None else probe
        checking = scaler is not None or skip_nonfinite
        # Reading the decision is a host-device sync: the one of this update.
        if checking and decider is not None and not math.isfinite(decider.item()):
            if scaler is not None:
                scaler.update()  # backs the scale off (the inf checks were recorded by unscale_)
            return False, norm, decider
        if max_grad_value is not None:
            torch.nn.utils.clip_grad_value_([p for p in params() if p.grad is not None], max_grad_value)
        if before_step is not None:
            before_step()
        for optimizer in optimizers:
            optimizer.step()  # unscaled and checked above: what GradScaler.step would run
        if scaler is not None:
            scaler.update()
        return True, norm, decider
    except BaseException:
        if scaler is not None:
            scaler.update(new_scale=scaler.get_scale())  # forgets this update's unscale_, keeps the scale
        raise

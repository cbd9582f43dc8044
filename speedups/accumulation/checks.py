"""Every check ``@accumulate`` makes on what it is handed, each before anything changes.

The arguments, once at decoration (through :mod:`speedups._helpers.validate`); the result of the user's
function (a scalar loss with a ``grad_fn``, maybe with an item count) on every call that leaves the fast path,
before any gradient is touched. A checkpoint state is checked where it is made (:mod:`.state`).
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.callers import user_stacklevel
from speedups._helpers.step_context import check_clipping
from speedups._helpers.validate import short
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = [
    "check_arguments",
    "check_outer_autocast",
    "check_result",
    "refuse_reentry",
    "refuse_freed_graph",
    "warn_skipped",
]


def check_arguments(
    every: Any,
    optimizer: Any,
    scheduler: Any,
    max_grad_norm: Any,
    model: Any,
    skip_nonfinite: Any,
    enabled: Any,
    *,
    stacklevel: int,
    max_grad_value: Any = None,
) -> tuple[int, tuple[torch.optim.Optimizer, ...], tuple[Any, ...], float | None, float | None]:
    """Check the arguments of ``accumulate(...)``.

    Returns ``every``, the optimizers and the schedulers as tuples (one optimizer or a list of them; None,
    one scheduler or a list), ``max_grad_norm`` and ``max_grad_value`` (floats or None). Warns (rank 0,
    at ``stacklevel`` above this call) when a multi-process job gives no ``model=``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``every < 1``; no optimizer, the same optimizer twice or a parameter in two of them; a
            scheduler of an optimizer not given; ``max_grad_norm`` or ``max_grad_value`` not a positive
            finite number, or both given.
    """
    if isinstance(every, torch.optim.Optimizer):
        raise TypeError(
            f"accumulate({type(every).__name__}(...), {short(optimizer)}): the arguments are swapped; the "
            f"window (micro-steps per optimizer step) comes first. Write accumulate({short(optimizer)}, "
            f"optimizer)."
        )
    with validate.arguments(f"accumulate({short(every)}, optimizer, ...)"):
        every = validate.integer(every, "every", minimum=1, example="4")
        optimizers = _optimizers(optimizer, every)
        schedulers = _schedulers(scheduler, optimizers, every)
        max_grad_norm, max_grad_value = check_clipping(max_grad_norm, max_grad_value)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"model={short(model)}: expected a torch.nn.Module (the DDP or FSDP2 model) or None, got "
                f"{type(model).__name__}."
            )
        validate.flag(skip_nonfinite, "skip_nonfinite")
        validate.flag(enabled, "enabled")
    if model is None and env.is_distributed() and env.rank() == 0:
        warnings.warn(
            f"accumulate({every}, optimizer): this is a multi-process job but no model= was given, so the "
            f"step cannot use DDP's no_sync() between boundaries (every micro-step all-reduces) and "
            f"normalises num_items per rank. Pass it: accumulate({every}, optimizer, model=model).",
            SpeedupsWarning,
            stacklevel=stacklevel,
        )
    return every, optimizers, schedulers, max_grad_norm, max_grad_value


def _optimizers(optimizer: Any, every: int) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer=`` as a tuple: one optimizer, or a list/tuple of distinct ones sharing no parameter."""
    if optimizer is None:
        raise TypeError(
            f"optimizer=None: accumulate needs the optimizer it steps at every boundary. Write "
            f"accumulate({every}, torch.optim.SGD(model.parameters(), lr=0.1))."
        )
    given = tuple(optimizer) if isinstance(optimizer, (list, tuple)) else (optimizer,)
    fix = f"Write accumulate({every}, optimizer) or accumulate({every}, [backbone_opt, head_opt])."
    if not given:
        raise ValueError(f"optimizer=[]: expected at least one torch.optim.Optimizer. {fix}")
    for opt in given:
        if not isinstance(opt, torch.optim.Optimizer):
            got = type(opt).__name__
            if given[0] is not optimizer:
                got = f"a {type(optimizer).__name__} of {got}"
            if isinstance(opt, torch.Tensor):  # model.parameters() passed where the optimizer goes
                fix = f"Build the optimizer first: accumulate({every}, torch.optim.SGD(model.parameters()))."
            raise TypeError(
                f"optimizer={short(optimizer)}: expected a torch.optim.Optimizer or a list of them, got "
                f"{got}. {fix}"
            )
    if len({id(opt) for opt in given}) != len(given):
        raise ValueError(f"optimizer={short(optimizer)}: the same optimizer is listed twice. {fix}")
    seen: set[int] = set()
    for i, opt in enumerate(given):
        ids = {id(p) for group in opt.param_groups for p in group["params"]}
        if ids & seen:
            raise ValueError(
                f"optimizer=[...]: optimizer[{i}] ({type(opt).__name__}, counted from 0) holds a parameter "
                f"an earlier one holds too, so one update would step it twice. Give each parameter to one "
                f"optimizer."
            )
        seen |= ids
    return given


def _schedulers(scheduler: Any, optimizers: tuple[torch.optim.Optimizer, ...], every: int) -> tuple[Any, ...]:
    """``scheduler=`` as a tuple: None, one scheduler or a list, each stepped once per optimizer step."""
    if scheduler is None:
        return ()
    given = tuple(scheduler) if isinstance(scheduler, (list, tuple)) else (scheduler,)
    for sched in given:
        if isinstance(sched, torch.optim.Optimizer):
            raise TypeError(
                f"scheduler={short(scheduler)}: holds an optimizer ({type(sched).__name__}), which "
                f"@accumulate would step twice per update. Pass the optimizers as the second argument, "
                f"accumulate({every}, [opt_a, opt_b]), and only LR schedulers as scheduler=."
            )
        if not callable(getattr(sched, "step", None)):
            raise TypeError(
                f"scheduler={short(sched)}: expected an LR scheduler with a step() method (or a list of "
                f"them) or None, got {type(sched).__name__}."
            )
        if _needs_arguments(sched.step):
            raise TypeError(
                f"scheduler={type(sched).__name__}: its step() needs an argument (ReduceLROnPlateau "
                f"needs the metric), but @accumulate calls scheduler.step() with none after each optimizer "
                f"step. Allowed: a scheduler stepped per optimizer step (StepLR, OneCycleLR, LambdaLR...). "
                f"Fix: leave it out of accumulate(...) and step it yourself after validation: "
                f"`scheduler.step(val_loss)`."
            )
        owner = getattr(sched, "optimizer", None)
        if isinstance(owner, torch.optim.Optimizer) and all(owner is not opt for opt in optimizers):
            raise ValueError(
                f"scheduler={type(sched).__name__}: it schedules another optimizer than this step's, so "
                f"stepping it would change a learning rate this step never uses. Build it on the same one: "
                f"scheduler = {type(sched).__name__}(optimizer, ...); accumulate({every}, optimizer, "
                f"scheduler=scheduler)."
            )
    if len({id(sched) for sched in given}) != len(given):
        raise ValueError(f"scheduler={short(scheduler)}: the same scheduler is listed twice.")
    return given


def _needs_arguments(step: Any) -> bool:
    """Whether ``step()`` cannot be called without arguments (False when its signature cannot be read)."""
    try:
        inspect.signature(step).bind()
    except TypeError:
        return True
    except ValueError:  # no signature to read (a builtin): assume it can
        return False
    return False


def check_result(out: Any) -> tuple[torch.Tensor, Any]:
    """Split what the step function returned into ``(loss, num_items)`` (``num_items`` None for a bare loss).

    Raises:
        TypeError: no loss tensor, or a ``num_items`` that is neither a number nor a tensor.
        ValueError: a loss that is not a floating-point scalar with a ``grad_fn``; a ``num_items`` that is not
            one finite real >= 0 (a tensor's value is checked at the boundary, where it is read anyway:
            ``Window.has_items``), or a tensor that requires grad.
    """
    n = None
    loss = out
    if isinstance(out, tuple) and len(out) == 2:
        loss, n = out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"accumulate: the step returned {type(out).__name__} {short(out)}: expected a scalar loss "
            f"tensor, or a (loss, num_items) tuple. Return e.g. F.cross_entropy(model(x), y)."
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"accumulate: the step returned a loss of shape {tuple(loss.shape)} and dtype {loss.dtype}: "
            f"expected a floating-point scalar. Reduce it first, e.g. return loss.mean()."
        )
    if loss.grad_fn is None:
        raise ValueError(
            "accumulate: the step returned a loss without grad_fn (computed under torch.no_grad(), "
            "or detached): backward cannot reach the parameters. Return the loss of the forward pass, "
            "not loss.detach() or loss.item()."
        )
    if n is not None:
        if isinstance(n, torch.Tensor):
            if n.requires_grad:
                raise ValueError(
                    f"accumulate: the step returned num_items={short(n)}, a tensor that requires grad: a "
                    f"count of items has no gradient, so this is likely a model output (`return loss, out`: "
                    f"the prediction) in num_items' place. Return (loss, len(y)) or (loss, mask.sum()); to "
                    f"hand out a prediction too, {{'loss': loss, 'num_items': len(y), 'prediction': out}}."
                )
            if n.numel() != 1 or n.dim() > 1 or n.is_complex() or n.dtype == torch.bool:
                raise ValueError(
                    f"accumulate: the step returned num_items of shape {tuple(n.shape)} and dtype "
                    f"{n.dtype}: expected a real count, a 0-dim tensor or one of shape (1,), or a number "
                    f"(items in the batch; a (1, 1) tensor is a model's output for one sample). To "
                    f"hand out more than the loss (a prediction, logits), return a mapping: "
                    f"{{'loss': loss, 'num_items': len(y), 'logits': logits}}."
                )
        elif isinstance(n, bool) or not isinstance(n, numbers.Real):
            raise TypeError(
                f"accumulate: the step returned num_items={n!r}: expected an int, a float or a "
                f"one-element tensor. Return (loss, len(y)) or (loss, mask.sum())."
            )
        elif not (_finite(n) and float(n) >= 0):
            raise ValueError(
                f"accumulate: the step returned num_items={n!r}: expected a finite count >= 0. "
                f"Return (loss, len(y))."
            )
    return loss, n


def _finite(n: numbers.Real) -> bool:
    try:
        return math.isfinite(float(n))
    except OverflowError:  # an int too large for a float
        return False


def refuse_reentry(step: int, pending: int, every: int) -> None:
    """Raise: the step was called from inside its own call (before anything of the inner call changed).

    Raises:
        SpeedupsError: always.
    """
    raise SpeedupsError(
        f"accumulate: the step was called from inside itself (during micro-step {step + 1}, with {pending} "
        f"of {every} micro-steps of the window accumulated). The inner call would count, weigh and maybe "
        f"apply the window in the middle of the outer one. Call the step once per micro-batch, from the "
        f"loop; to reuse its loss code inside it, call a plain (undecorated) function."
    )


def refuse_freed_graph(err: RuntimeError, step: int) -> None:
    """Raise a ``SpeedupsError`` with the fix when ``err`` is torch's "backward through the graph a second
    time" from the step's own backward: the step's function ran ``loss.backward()`` itself (a migrated
    loop's leftover). Return for any other error (the caller re-raises it).

    Raises:
        SpeedupsError: ``err`` says the graph was already freed.
    """
    if "backward through the graph a second time" not in str(err):
        return
    raise SpeedupsError(
        f"accumulate: the step's backward found the loss's graph already freed (micro-step {step + 1}): the "
        f"step's function ran `loss.backward()` itself. @accumulate runs the backward, weighted 1/N: remove "
        f"the backward() call and return the loss (with several losses, return their sum: `aux.backward(); "
        f"return main` becomes `return main + aux`). Nothing of this micro-step was counted; the gradients "
        f"its backward() left are dropped when the next window starts."
    ) from err


def check_outer_autocast(device_type: str) -> None:
    """Refuse a step without a GradScaler that runs inside an fp16 autocast entered outside the step.

    Called after the user's function returned, so any autocast still active was entered around the step:
    ``@mixed_precision("fp16")`` stacked above ``@accumulate``, or a ``with`` around the loop. Its loss
    scaling would be silently lost (fp16 gradients unscaled). No sync: two reads of torch's autocast state.

    Raises:
        SpeedupsError: fp16 autocast is on for ``device_type`` (nothing of this micro-step applied yet).
    """
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.float16:
        raise SpeedupsError(
            f"accumulate: the step runs inside an fp16 autocast ({device_type}) entered outside it, "
            f"e.g. @mixed_precision('fp16') stacked above @accumulate or `with mixed_precision('fp16'):` "
            f"around the loop, so the step never gets its GradScaler: fp16 gradients would go unscaled "
            f"(loss scaling silently lost). Fix: put mixed_precision under the step, `@accumulate(...)` "
            f"then `@amp` right above `def train_step(...)`, or `with amp:` inside its body."
        )


def warn_skipped(step: int, *, empty: bool, clipping: bool = False) -> None:
    """Warn (at the user's line) that the window ending at micro-step ``step`` was not applied: it held 0
    items, or NaN/inf."""
    if empty:
        why = (
            "holds 0 items (every num_items was 0): there is nothing to learn from it, so the optimizer "
            "step and the scheduler step were skipped."
        )
    else:
        why = (
            "has NaN or inf gradients (a non-finite loss, or an overflow): the optimizer step and the "
            "scheduler step were skipped and the gradients dropped. Lower the learning rate"
            + ("." if clipping else " or clip (max_grad_norm=1.0).")
        )
    message = f"accumulate: the window ending at micro-step {step} {why}"
    warnings.warn(message, SpeedupsWarning, stacklevel=user_stacklevel())

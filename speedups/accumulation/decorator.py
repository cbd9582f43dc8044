"""Tip 4: ``@accumulate``, gradient accumulation that equals the big batch, at no extra cost per micro-step.

The decorator checks its arguments once, then gives each decorated function an
:class:`~speedups.accumulation.accumulator.Accumulator` (the state and the call path) and returns the
:class:`~speedups.accumulation.step.Step` the user holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from speedups.accumulation.accumulator import Accumulator
from speedups.accumulation.checks import check_arguments
from speedups.accumulation.grad_sync import SyncKind, grad_sync_for
from speedups.accumulation.micro_batching import (
    AUTO,
    MemoryPlan,
    MicroBatcher,
    check_memory_budget,
    check_micro_batching,
)
from speedups.accumulation.step import Step
from speedups.errors import SpeedupsError

__all__ = ["accumulate"]

F = TypeVar("F", bound=Callable[..., Any])


def accumulate(
    every: int,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    max_grad_value: float | None = None,
    model: torch.nn.Module | None = None,
    skip_nonfinite: bool = False,
    micro_batch_size: int | str | None = None,
    split: Callable[..., Any] | None = None,
    memory_budget: int | str | None = None,
    enabled: bool = True,
) -> Callable[[F], F]:
    """Turn a function that returns a micro-batch loss into a gradient-accumulation training step.

    Every call runs backward; every ``every``-th call (the boundary) normalises the gradients to the exact
    mean of the window, unscales (fp16 ``mixed_precision``) and clips them once, then runs
    ``optimizer.step()``, ``scheduler.step()`` and ``zero_grad()``: the big batch's step in one micro-batch's
    memory (not faster; batch norm still sees micro-batches). Several optimizers (a backbone's and a head's)
    share one window: each is unscaled once, the norm is clipped over all of them, and all step or none.
    ``(loss, num_items)`` weighs calls by items ("Fixing Gradient Accumulation", Hugging Face, 2024). A DDP
    ``model=`` runs non-boundary calls in ``no_sync()``; an FSDP2 one turns gradient sync off between
    boundaries. ``train_step.flush()`` (or ``train_step.epoch(loader)``) applies a short last window;
    ``train_step.on_update(fn)`` runs ``fn`` after every optimizer step really taken (EMA, per-update
    logging); ``train_step.before_update(fn)`` runs ``fn(params)`` on the final gradients just before it.
    A step's backward leaves no gradient on another step's parameters (a GAN's generator loss on D); a
    window never starts on gradients no step made (dropped, warned once). Stepping the optimizer by hand,
    ``zero_grad()`` while a window is open, or a ``backward()`` inside the step warns once.

    Sync points: none by default; one per optimizer step with ``skip_nonfinite=True``, an fp16 GradScaler, or
    a device-tensor ``num_items`` (is the window empty? A window of 0 items skips the optimizer step).
    State: ``.step``, ``.is_boundary``, ``.num_updates``, ``.pending``, ``.scaler``, ``.last_step_skipped``,
    ``.found_inf``, ``.last_grad_norm``, ``.micro_batch_size`` (None under ``"auto"`` until a call runs out
    of memory).
    Not thread-safe; cannot be pickled (a ``wrapt.FunctionWrapper``).

    Args:
        every: micro-steps per optimizer step (N >= 1).
        optimizer: the ``torch.optim.Optimizer`` holding the parameters, or a list of them (no parameter in
            two), all stepped at every boundary.
        scheduler: stepped after each optimizer step that really happened (anything with ``.step()``), or a
            list of them, each built on one of the optimizers.
        max_grad_norm: clip the total 2-norm of the normalised, unscaled gradients to this; None: no clipping.
        max_grad_value: clamp each element of those gradients to ``[-v, v]`` (``clip_grad_value_``) once per
            update; an fp16 overflow still skips the step. Not together with ``max_grad_norm``.
        model: the model, needed when it is a ``DistributedDataParallel`` or an FSDP2 module; the gradient
            norm then sums in ``model.parameters()`` order, bit-identical to ``clip_grad_norm_``'s.
        skip_nonfinite: skip (and warn about) a window whose loss or gradient is NaN/inf; one sync per step.
        micro_batch_size: split each call's tensors along dim 0 into micro-batches of at most this many rows,
            weighed exactly; ``"auto"``: whole batches, halved on out of memory (see ``micro_batching``;
            not with FSDP2 on several ranks, whose collectives no rank can run again alone).
        split: ``split(args, kwargs, size) -> [(args, kwargs), ...]`` for batches the dim-0 rule cannot split.
        memory_budget: bytes the activations may take (``"auto"``: the GPU's free memory, the CPU's available
            memory). The first calls measure, then keep the fastest mix of micro-batch size (halvings of the
            batch; the given one if an int) and checkpointed blocks of ``model=`` that fits (see
            ``micro_batching.memory_plan``); ``train_step.memory_plan`` shows it. CPU: counted activation
            bytes; GPU: measured peak. Needs ``model=``; not with FSDP2.
        enabled: False steps on every call (``every`` taken as 1), for A/B comparisons.

    Returns:
        A decorator. The step returns the detached 0-dim loss, ``(loss.detach(), num_items)``, or the
        step's mapping ``{"loss": ..., "num_items": ..., **extras}`` with its tensors detached.

    Raises:
        TypeError, ValueError: a bad argument; at call time (before any gradient is touched), a result that
            is not a scalar loss with a ``grad_fn``, or a bad ``num_items``.
        SpeedupsError: a call switches between a bare loss and ``(loss, num_items)``; at decoration, a
            ``memory_budget`` or ``micro_batch_size="auto"`` with an FSDP2 model on several ranks.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> @accumulate(2, opt)
        ... def train_step(x, y):
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> for _ in range(5):
        ...     loss = train_step(torch.ones(4, 3), torch.zeros(4, 1))
        >>> train_step.step, train_step.num_updates, train_step.pending
        (5, 2, 1)
        >>> train_step.flush(); train_step.num_updates, train_step.pending
        (3, 0)
    """
    if callable(every) and not isinstance(every, type):
        raise TypeError(
            f"@accumulate above {getattr(every, '__name__', 'a function')}: accumulate takes its window and "
            f"its optimizer first. Write @accumulate(4, optimizer) above `def train_step(...)`."
        )
    every, optimizers, schedulers, max_grad_norm, max_grad_value = check_arguments(
        every, optimizer, scheduler, max_grad_norm, model, skip_nonfinite, enabled, stacklevel=3,
        max_grad_value=max_grad_value,
    )  # fmt: skip
    check_micro_batching(micro_batch_size, split, every)
    check_memory_budget(memory_budget, model, every)
    if memory_budget is not None and micro_batch_size is None:
        micro_batch_size = AUTO

    def decorator(fn: F) -> F:
        if _already_a_step(fn):
            raise TypeError(
                f"accumulate({every!r}, optimizer)({getattr(fn, '__name__', 'step')}): the function is "
                f"already an @accumulate step (stacked twice?), whose call returns a detached loss. Decorate "
                f"the plain function once: one @accumulate(N, [opt_a, opt_b]) can step several optimizers."
            )
        if isinstance(fn, type) or not callable(fn):
            what = fn.__name__ if isinstance(fn, type) else repr(fn)
            raise TypeError(
                f"accumulate({every!r}, optimizer)({what}): expected the step function (or method) that "
                f"returns the micro-batch loss; decorate `def train_step(x, y): return loss_fn(model(x), y)`."
            )
        sync = grad_sync_for(model)
        sync.check_window(every if enabled else 1, micro_batch_size is not None)  # before anything changes
        fsdp2_ranks = sync.world if sync.kind is SyncKind.FSDP2 else 1
        if micro_batch_size == AUTO and memory_budget is None and fsdp2_ranks > 1:
            raise SpeedupsError(
                f"accumulate({every}, optimizer, micro_batch_size='auto', model=<FSDP2 on {sync.world} "
                f"ranks>): 'auto' halves the micro-batch after an out-of-memory error and runs the call "
                f"again, but the other ranks are then inside the forward's parameter all-gathers, which "
                f"every rank must call alike: one rank cannot run its call again alone, and the ranks "
                f"cannot agree on a smaller size in the middle of a collective. Give micro_batch_size=<int>: "
                f"the size find_batch_size(...) finds on one rank, or one that fits beside the sharded model."
            )
        plan = None
        if memory_budget is not None:
            if sync.kind is SyncKind.FSDP2:
                raise SpeedupsError(
                    f"accumulate({every}, optimizer, memory_budget={memory_budget!r}, model=<FSDP2>): the "
                    f"plan tries several micro-batch sizes, and an FSDP2 forward gathers parameters with "
                    f"collectives that every rank must call alike. Give micro_batch_size=<int> and "
                    f"checkpoint blocks with checkpoint_activations(model, names)."
                )
            fixed = micro_batch_size if isinstance(micro_batch_size, int) else None
            plan = MemoryPlan(memory_budget, model, fixed, sync.world)  # type: ignore[arg-type]
        acc = Accumulator(
            every if enabled else 1,
            optimizers,
            schedulers,
            max_grad_norm,
            sync,  # one strategy per step: it holds the window's sync state
            skip_nonfinite,
            None if micro_batch_size is None else MicroBatcher(micro_batch_size, split, plan, model),
            model=model,
            guard=enabled,  # a plain step on every call (enabled=False) owns no window to guard
            max_grad_value=max_grad_value,
        )
        return Step(fn, acc)  # type: ignore[return-value]

    return decorator


def _already_a_step(fn: object) -> bool:
    """Whether ``fn`` or a function it wraps (``__wrapped__``: mixed_precision, functools.wraps) is a Step."""
    for _ in range(16):
        if issubclass(type(fn), Step):
            return True
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            return False
        fn = inner
    return False

"""Tip 3: find the largest batch size that fits, without changing the model you probe.

``find_batch_size(step, model, optimizer)`` runs your training step at growing batch sizes until memory runs
out, and returns the largest size that actually ran. Everything the probe touches is put back exactly:
parameters and buffers (BatchNorm running statistics and ``num_batches_tracked``), the optimizer state
(Adam's moments and step counts), train/eval flags, ``requires_grad`` flags, gradients and the global RNG
states. ``accumulation_plan`` then turns the effective batch you want into a micro-batch that fits and an
accumulation count.
"""

from __future__ import annotations

import copy
import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from speedups._helpers import env, validate
from speedups._helpers.oom import is_out_of_memory
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups.errors import SpeedupsError

__all__ = ["find_batch_size", "accumulation_plan", "AccumulationPlan"]

_MODES = ("power", "binsearch")
# Without max_size the search stops here: a step that runs at 2**24 samples per batch without running out of
# memory almost surely ignores its batch_size (or memory is not what limits it), and doubling would not end.
_UNBOUNDED_LIMIT = 2**24


# ------------------------------------------------------------------------------------------ state snapshot
def _to_cpu_copy(value: Any) -> Any:
    """A deep copy with every tensor on the CPU (keeps the probe's device memory free)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_cpu_copy(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu_copy(v) for v in value)
    return copy.deepcopy(value)


def _unique_parameters(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[nn.Parameter]:
    params: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        params.setdefault(id(p), p)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                params.setdefault(id(p), p)
    return list(params.values())


class _Snapshot:
    """Everything a probe step may change, copied to the CPU, and put back bitwise by :meth:`restore`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.model_state = _to_cpu_copy(model.state_dict())
        persistent = set(self.model_state)
        # non-persistent buffers are not in state_dict but may still change
        self.other_buffers = {
            name: b.detach().to("cpu", copy=True)
            for name, b in model.named_buffers()
            if name not in persistent and b is not None
        }
        self.params = _unique_parameters(model, optimizer)
        in_model = {id(p) for p in model.parameters()}
        self.outside_values = [
            (p, p.detach().to("cpu", copy=True)) for p in self.params if id(p) not in in_model
        ]
        self.requires_grad = [p.requires_grad for p in self.params]
        # the gradient tensors themselves (restored in place, so references to them stay valid) and copies
        self.grads = [
            (p.grad, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in self.params
        ]
        self.training = [(m, m.training) for m in model.modules()]
        self.optimizer_state = None if optimizer is None else _to_cpu_copy(optimizer.state_dict())
        self.rng = get_rng_states()

    @torch.no_grad()
    def restore(self) -> None:
        # Drop the probe's gradients first: frees memory before anything is copied back.
        for p in self.params:
            p.grad = None
        self.model.load_state_dict(self.model_state)
        for name, saved in self.other_buffers.items():
            self.model.get_buffer(name).copy_(saved)
        for p, saved in self.outside_values:
            p.copy_(saved)
        for p, flag, (grad, grad_copy) in zip(self.params, self.requires_grad, self.grads, strict=True):
            p.requires_grad_(flag)
            if grad is not None and grad_copy is not None:
                grad.copy_(grad_copy)
            p.grad = grad
        for module, flag in self.training:
            module.training = flag
        if self.optimizer is not None:
            # load_state_dict copies: the snapshot stays intact for the next restore
            self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))  # type: ignore[arg-type]
        set_rng_states(self.rng)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        mps.empty_cache()


@contextmanager
def _restoring(snapshot: _Snapshot) -> Iterator[None]:
    try:
        yield
    finally:
        snapshot.restore()


# ------------------------------------------------------------------------------------------ find_batch_size
def _check_arguments(
    step: object, model: object, optimizer: object, start: object, max_size: object, mode: object
) -> None:
    said = f"find_batch_size(start={start!r}, max_size={max_size!r}, mode={mode!r})"
    if not callable(step):
        raise TypeError(
            f"find_batch_size(step={step!r}): step must be a callable that runs one training step at a "
            f"batch size. Pass e.g. `def step(batch_size): ...` as find_batch_size(step, model, optimizer)."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"find_batch_size(model={type(model).__name__}): model must be the torch.nn.Module the step "
            f"trains, so its state can be restored. Pass find_batch_size(step, model, optimizer)."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"find_batch_size(optimizer={type(optimizer).__name__}): optimizer must be a "
            f"torch.optim.Optimizer or None. Pass the optimizer the step calls .step() on."
        )
    with validate.arguments(said):
        validate.integer(start, "start", minimum=1, example="2")
        validate.integer(max_size, "max_size", minimum=1, none_ok=True, example="4096")
    if max_size is not None and start > max_size:  # type: ignore[operator]
        raise ValueError(
            f"{said}: start is larger than max_size. Allowed: 1 <= start <= max_size. "
            f"Pass e.g. start=2, max_size={max_size}."
        )
    if mode not in _MODES:
        raise ValueError(f"{said}: unknown mode. Allowed: {_MODES}. Pass mode='power' or mode='binsearch'.")


def find_batch_size(
    step: Callable[[int], object],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    start: int = 2,
    max_size: int | None = None,
    mode: str = "power",
) -> int:
    """Return the largest batch size at which ``step(batch_size)`` runs without running out of memory.

    ``step(batch_size)`` runs one whole training step as your loop does (forward, backward,
    ``optimizer.step()``, so optimizer state is counted). Sizes double from ``start``; on out-of-memory the
    search backs off (``"power"``: the last success; ``"binsearch"``: then bisects). The result always ran.
    Out of memory is one shared rule: ``torch.OutOfMemoryError``, the allocators' ``RuntimeError`` texts and
    cuDNN's large-batch ``CUDNN_STATUS_NOT_SUPPORTED``, as Lightning's and Accelerate's finders count them.
    Every probe's effects are undone bitwise (model and optimizer state, buffers, train flags,
    ``requires_grad``, ``.grad``, global RNG states), from a snapshot in host memory. It does not see memory
    that grows over steps or other input shapes: leave headroom. On the CPU pass ``max_size`` (the OS may
    kill the process instead of raising). Method: Lightning's ``BatchSizeFinder`` scaling, fully restored.
    Sync points: whatever ``step`` does; each restore copies host to device.

    Args:
        step: ``step(batch_size: int)`` runs one training step; its return value is ignored.
        model: the module the step trains (its state is snapshotted and restored).
        optimizer: the optimizer the step uses, or None.
        start: first size to try (>= 1).
        max_size: largest size to try (>= start), or None for no limit but memory.
        mode: ``"power"`` (doubling only) or ``"binsearch"`` (doubling, then bisection).

    Returns:
        The largest batch size (an int >= 1) whose step completed.

    Raises:
        TypeError, ValueError: bad arguments (checked before anything runs).
        SpeedupsError: even batch size 1 runs out of memory; or, without ``max_size``, the step still fits at
            2**24 samples (its memory does not grow with the size): the search stops instead of doubling on.
        Exception: any error of ``step`` that is not out-of-memory, re-raised unchanged (state restored).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        >>> opt = torch.optim.Adam(model.parameters())
        >>> def step(batch_size):
        ...     if batch_size > 40:  # pretend the device holds at most 40 samples
        ...         raise torch.cuda.OutOfMemoryError("out of memory")
        ...     model(torch.randn(batch_size, 4)).sum().backward()
        ...     opt.step()
        >>> find_batch_size(step, model, opt, start=2, mode="binsearch")
        40
        >>> len(opt.state)  # the probe's Adam state was removed again
        0
    """
    _check_arguments(step, model, optimizer, start, max_size, mode)
    snapshot = _Snapshot(model, optimizer)

    def fits(size: int) -> bool:
        failed = False
        with _restoring(snapshot):
            try:
                step(size)
            except BaseException as err:
                if not is_out_of_memory(err):
                    raise
                failed = True  # leave the except block first: the traceback holds the step's tensors
        if failed:
            _free_memory()
        return not failed

    last_ok: int | None = None
    first_fail: int | None = None
    size = start
    while True:
        if fits(size):
            last_ok = size
            if max_size is not None and size >= max_size:
                break
            if max_size is None and size >= _UNBOUNDED_LIMIT:
                raise SpeedupsError(
                    f"find_batch_size(step, model, optimizer, start={start!r}, max_size=None): the step ran "
                    f"at every size up to {size} without running out of memory, so its memory does not grow "
                    f"with batch_size (does step build a batch of batch_size samples?), and the search "
                    f"would never end. Make step use its argument, or give the largest size you want: "
                    f"find_batch_size(step, model, optimizer, max_size=4096)."
                )
            size = size * 2 if max_size is None else min(size * 2, max_size)
        else:
            first_fail = size
            break
    if last_ok is None:  # start failed: back off by halving
        size = start // 2
        while size >= 1:
            if fits(size):
                last_ok = size
                break
            first_fail = size
            size //= 2
        if last_ok is None:
            raise SpeedupsError(
                f"find_batch_size(start={start!r}): even batch size 1 runs out of memory. Free memory "
                f"first (a smaller model, mixed precision, activation checkpointing), or use another device."
            )
    if mode == "binsearch" and first_fail is not None:
        lo, hi = last_ok, first_fail
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        last_ok = lo
    return last_ok


# ------------------------------------------------------------------------------------------ accumulation_plan
class AccumulationPlan(NamedTuple):
    """A micro-batch size and an accumulation count whose product, over all ranks, is the effective batch.

    ``micro_batch_size * accumulation_steps * world_size == effective_batch_size`` exactly.
    """

    micro_batch_size: int
    accumulation_steps: int
    world_size: int

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step, over all ranks."""
        return self.micro_batch_size * self.accumulation_steps * self.world_size


def accumulation_plan(
    effective_batch_size: int, max_micro_batch_size: int, *, world_size: int | None = None
) -> AccumulationPlan:
    """Split an effective batch into the largest micro-batch that fits and an ``@accumulate`` count.

    Gradient accumulation over ``k`` micro-batches of size ``b`` on ``w`` ranks equals one step on a batch
    of ``b * k * w`` samples; this picks the largest ``b <= max_micro_batch_size`` that divides the
    per-rank batch exactly, so the product is the effective batch with no remainder (a remainder would
    change the learning dynamics). An effective batch with few divisors (a prime) can force small
    micro-batches: prefer sizes such as 256, 384, 1000.

    Args:
        effective_batch_size: samples per optimizer step over all ranks (>= 1), divisible by the world size.
        max_micro_batch_size: the largest micro-batch that fits, e.g. from :func:`find_batch_size`.
        world_size: data-parallel ranks; None reads it from the process group or ``WORLD_SIZE``.

    Returns:
        An :class:`AccumulationPlan` ``(micro_batch_size, accumulation_steps, world_size)``.

    Raises:
        TypeError: an argument is not an int.
        ValueError: a value < 1, or an effective batch not divisible by the world size.

    Example:
        >>> accumulation_plan(256, 48, world_size=1)
        AccumulationPlan(micro_batch_size=32, accumulation_steps=8, world_size=1)
        >>> accumulation_plan(256, 48, world_size=2).effective_batch_size
        256
    """
    said = (
        f"accumulation_plan(effective_batch_size={effective_batch_size!r}, "
        f"max_micro_batch_size={max_micro_batch_size!r}, world_size={world_size!r})"
    )
    ws = env.world_size() if world_size is None else world_size
    with validate.arguments(said):
        validate.integer(effective_batch_size, "effective_batch_size", minimum=1, example="256")
        validate.integer(effective_batch_size, "effective_batch_size", maximum=2**40, example="256")
        validate.integer(max_micro_batch_size, "max_micro_batch_size", minimum=1, example="32")
        validate.integer(ws, "world_size", minimum=1, example="2")
    if effective_batch_size % ws:
        raise ValueError(
            f"{said}: the effective batch is not divisible by the world size {ws}, so ranks cannot share it "
            f"equally. Pass a multiple of {ws}, e.g. "
            f"effective_batch_size={effective_batch_size // ws * ws or ws}."
        )
    per_rank = effective_batch_size // ws
    micro = _largest_divisor_at_most(per_rank, max_micro_batch_size)
    return AccumulationPlan(micro, per_rank // micro, ws)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is <= ``limit``, from the divisor pairs up to sqrt(n)."""
    best = 1
    for small in range(1, math.isqrt(n) + 1):
        if n % small == 0:
            large = n // small
            if large <= limit:
                return max(best, large)  # the first large co-divisor under the limit is the largest
            if small <= limit:
                best = small
    return best

"""Tip 4: gradient accumulation that equals the big batch, at no extra cost per micro-step.

``@accumulate(N, optimizer)`` turns a function that returns a micro-batch loss into a training step: it runs
backward on every call and, on every N-th call (the boundary), normalises the accumulated gradients exactly,
unscales and clips them once, steps the optimizer (then the scheduler) and zeroes the gradients. How the
gradients reach the other ranks (DDP's ``no_sync()``, FSDP2's gradient-sync switch) is a
:mod:`speedups.grad_sync` strategy, chosen once when decorating.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from speedups import _step, _step_state
from speedups._step_checks import (
    check_arguments,
    check_outer_autocast,
    check_result,
    guard_optimizer,
    refuse_reentry,
    warn_skipped,
)
from speedups._step_output import as_loss_and_items, result_of
from speedups._step_wrapper import Step
from speedups._zero_items import GradMask, keep_of
from speedups.errors import SpeedupsError
from speedups.grad_sync import SyncKind, count_dtype, grad_sync_for
from speedups.micro_batching import make_micro_batcher

__all__ = ["accumulate"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class _Mode(enum.Enum):
    """How the calls of a window are weighed, fixed by the first call: alike, or by their item count."""

    MEAN = "mean"
    ITEMS = "items"


_MEAN, _ITEMS = _Mode.MEAN, _Mode.ITEMS  # module globals: read on every call, faster than _Mode.MEAN


class _Accumulator:
    """The state of one decorated step: the position in the window, the item count, the adopted scaler."""

    def __init__(
        self,
        every: int,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        max_grad_norm: float | None,
        model: torch.nn.Module | None,
        skip_nonfinite: bool,
        micro_batch_size: Any = None,
        split: Any = None,
    ) -> None:
        self.every = every
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.scaler: torch.amp.GradScaler | None = None
        self.mode: _Mode | None = None  # fixed by the first call
        self.step = 0  # micro-steps so far
        self.num_updates = 0  # optimizer steps really taken
        self.pending = 0  # calls in the open window
        self.is_boundary = False
        self.last_step_skipped = False
        self.probe: torch.Tensor | None = None  # checked for finiteness at the last update
        self.losses: list[torch.Tensor] = []  # the open window's detached losses (single process)
        self.ref_n: Any = 1.0  # the weight reference of the window's item counts (see GradSync.reference)
        self.total_host = 0.0  # items of the open window given as Python numbers
        self.total_device: torch.Tensor | None = None  # ... and as tensors
        self.inv_every = 1.0 / every
        self.sync = grad_sync_for(model)  # data parallelism, decided once
        self.skip_nonfinite = skip_nonfinite
        # One process: the summed loss tells whether to skip (cheaper than a gradient norm). Data parallel:
        # the gradient norm, identical on every rank after the sync, so every rank decides alike.
        self.check_losses = skip_nonfinite and self.sync.kind is SyncKind.SINGLE
        self.updating = False  # True while this step runs its own optimizer update
        self.mask = GradMask()  # drops the gradients of zero-item micro-steps (see speedups._zero_items)
        self.host_items = False  # this rank's open window counted items > 0 given as Python numbers
        self.warned_hand_step = False
        self.micro = make_micro_batcher(micro_batch_size, split, self.sync.kind, every)  # None: no split
        self.in_epoch = False  # True while an epoch() pass runs: a window then belongs to that pass
        self.resumed_in_epoch = False  # the restored window was saved inside an epoch() pass
        self.restored_scaler: dict[str, Any] | None = None  # a loaded scaler state, for the scaler to come
        self.stand_in = False  # the scaler is the step's own, built by a flush before mixed_precision's came

    # ------------------------------------------------------------------------------------------ call
    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        if self.scaler is None or self.stand_in:
            restored = _step_state.handed_over(self)  # a state loaded before the scaler existed, if any
            if restored is not None:
                scaler.load_state_dict(restored)
            elif self.pending:
                raise SpeedupsError(
                    f"accumulate: a GradScaler arrived in the middle of an accumulation window "
                    f"({self.pending} unscaled micro-steps already accumulated). Enter mixed_precision in "
                    f"every call of the step, from the first one, e.g. stack @mixed_precision('fp16') under "
                    f"@accumulate."
                )
            self.scaler, self.stand_in = scaler, False
        return self.scaler

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The wrapt wrapper: one micro-step."""
        if _step.current_step.get() is self:
            refuse_reentry(self.step, self.pending, self.every)
        if self.micro is not None:  # the call's batch split into micro-batches (speedups.micro_batching)
            return self.micro(self, wrapped, args, kwargs)
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        ctx = self.sync.micro_step(boundary)
        token = _step.current_step.set(self)
        try:
            with ctx:
                out = wrapped(*args, **kwargs)
                loss, n = self._parse(out)
                if self.scaler is None and self.pending == 0:  # once a window: an outer autocast spans it
                    check_outer_autocast(loss.device.type)
                detached = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
                work = None
                keep: Literal[False] | torch.Tensor | None = None  # None: every gradient of this call counts
                if n is None:
                    target, weight = loss, self.inv_every
                else:
                    (target, keep), weight = self._weigh_items(loss, n, first=self.pending == 0), 1.0
                    if boundary and self.sync.world > 1:
                        # The global item count, all-reduced while backward runs: the step's one extra
                        # collective, launched before DDP's bucket all-reduces on every rank (same order).
                        count = self._local_count(loss.device)
                        work = self.sync.reduce_count(count)
                        self.total_device, self.total_host = count, 0.0
                if self.check_losses and keep is not False:  # checked for NaN/inf at the boundary, in one go
                    self.losses.append(detached if keep is None else torch.where(keep, detached, 0.0))
                self._backward(target, keep, weight)
        finally:
            _step.current_step.reset(token)
        self.step += 1
        self.pending += 1
        if boundary:
            if work is not None:
                work.wait()
            self.sync.before_update(self.optimizer)
            self._update(synced=True)
        return detached if type(out) is torch.Tensor else result_of(out, detached, n)

    def _weigh_items(
        self, loss: torch.Tensor, n: Any, *, first: bool
    ) -> tuple[torch.Tensor, Literal[False] | torch.Tensor | None]:
        """The tensor to backward for a micro-step of ``n`` items (counted here), and the gradients it keeps.

        ``first``: the window's first micro-step, whose count is the weight reference.
        """
        if first:
            self.ref_n = self.sync.reference(n)
        self._add_items(n)
        return self.sync.weigh(loss, n, self.ref_n), keep_of(n)

    def _backward(
        self, target: torch.Tensor, keep: Literal[False] | torch.Tensor | None, weight: float = 1.0
    ) -> None:
        """Backward of ``target * weight``, scaled for the GradScaler if any; ``keep``: see ``keep_of``.

        Without a scaler or a mask, ``weight`` goes in as backward's output gradient, a new tensor of
        ``target``'s shape, dtype and device: what ``(target * weight).backward()`` sends into the graph, bit
        for bit, with one op and one autograd node fewer per micro-step. It is made on every call, as
        backward's own ``ones_like`` is: autograd may hand it on as a parameter's ``.grad`` (a loss that is a
        view of a parameter) or to a backward that edits its input.
        """
        if self.scaler is None and keep is None:  # the common case
            target.backward(None if weight == 1.0 else torch.full_like(target, weight))
            return
        if weight != 1.0:
            target = target * weight
        if self.scaler is not None:
            target = self.scaler.scale(target)
        if keep is None:  # every gradient counts: the plain backward
            target.backward()
        else:
            self.mask.backward(target, keep, self.optimizer, single=self.sync.kind is SyncKind.SINGLE)

    def _parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        if (  # the common case, in as few checks as possible; grad_fn implies a floating dtype
            self.mode is _MEAN
            and type(out) is torch.Tensor
            and out.dim() == 0
            and out.grad_fn is not None
            and not out.is_complex()
        ):
            return out, None
        loss, n = check_result(as_loss_and_items(out))
        mode = _MEAN if n is None else _ITEMS
        if self.mode is None:
            self.mode = mode
        elif mode != self.mode:
            raise SpeedupsError(
                f"accumulate: this step returned {'a bare loss' if n is None else '(loss, num_items)'} after "
                f"returning {'a bare loss' if self.mode == _MEAN else '(loss, num_items)'} before. "
                f"Return the same form on every call."
            )
        return loss, n

    def _add_items(self, n: Any) -> None:
        if isinstance(n, torch.Tensor):
            n = n.detach().reshape(()).to(count_dtype(n.device))
            self.total_device = n if self.total_device is None else self.total_device + n
        else:
            self.total_host += float(n)
            self.host_items = self.host_items or n > 0

    def _local_count(self, device: torch.device) -> torch.Tensor:
        if self.total_device is None:
            return torch.full((), self.total_host, dtype=count_dtype(device), device=device)
        return self.total_device + self.total_host

    # ---------------------------------------------------------------------------------------- update
    def _factor(self, synced: bool) -> float | torch.Tensor:
        """What the synchronised gradients must be multiplied by to be the window's exact mean."""
        averaged = self.sync.world if synced else 1  # DDP/FSDP2 divide by the world size when they sync
        if self.mode == _ITEMS:
            # A window of zero items (all padding) has nothing to learn from: its gradients are zeroed, never
            # divided by zero (an exact 0 count on the host also skips the optimizer step, see _update).
            if self.total_device is None:
                return averaged * self.ref_n / self.total_host if self.total_host else 0.0
            total = self.total_device + self.total_host
            return torch.where(total > 0, averaged * self.ref_n / total, torch.zeros_like(total)).float()
        return averaged * self.every / (self.sync.world * self.pending)

    def _has_items(self) -> bool:
        """Whether the window (all ranks) holds items; a sync only for device-tensor counts."""
        if self.total_device is None:
            return bool(self.total_host)
        if self.host_items:  # this rank counted items on the host, so the global sum is > 0 too
            return True
        return bool((self.total_device + self.total_host > 0).item())  # host-device sync, once per step

    def _update(self, synced: bool) -> None:
        # Whatever fails below (the optimizer, the scheduler, a warning turned error), the window is closed:
        # its gradients are dropped and the counters say what really happened, then the error propagates.
        try:
            if self.mode == _ITEMS and not self._has_items():
                self.last_step_skipped = True
                warn_skipped(self.step, empty=True)
                return
            factor = self._factor(synced)
            self.updating = True  # the optimizer step below is this step's own: its guard lets it pass
            try:
                stepped, self.probe = _step.apply_update(
                    self.optimizer,
                    self.scaler,
                    self.max_grad_norm,
                    factor,
                    skip_nonfinite=self.skip_nonfinite,
                    probe=torch.stack(self.losses).sum() if self.check_losses and self.losses else None,
                )
            finally:
                self.updating = False
            self.last_step_skipped = not stepped
            if stepped:
                self.num_updates += 1
                if self.scheduler is not None:
                    self.scheduler.step()
            elif self.scaler is None:
                warn_skipped(self.step, empty=False)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_window()

    def _reset_window(self) -> None:
        self.pending = 0
        self.total_host = 0.0
        self.total_device = None
        self.host_items = False
        self.losses = []
        self.ref_n = 1.0

    def flush(self) -> None:
        if not self.pending:
            return
        _step_state.stand_in_scaler(self)  # a restored fp16 window flushed before any fp16 call
        local_count = self._local_count if self.mode is _ITEMS else None
        count = self.sync.sync_window(self.optimizer, local_count, self.pending, self.every)
        if count is not None:
            self.total_device, self.total_host = count, 0.0
        try:
            self._update(synced=False)
        finally:
            self.sync.after_flush(self.optimizer)

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return _step_state.save(self)

    def check_state(self, state: Any) -> None:
        _step_state.check(self, state, tuple(mode.value for mode in _Mode))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)  # before any change
        _step_state.load(self, state, _Mode)


def accumulate(
    every: int,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    model: torch.nn.Module | None = None,
    skip_nonfinite: bool = False,
    micro_batch_size: int | str | None = None,
    split: Callable[..., Any] | None = None,
    enabled: bool = True,
) -> Callable[[F], F]:
    """Turn a function that returns a micro-batch loss into a gradient-accumulation training step.

    Every call runs backward; every ``every``-th call (the boundary) normalises the gradients to the exact
    mean of the window, unscales (fp16 ``mixed_precision``) and clips them once, then runs
    ``optimizer.step()``, ``scheduler.step()`` and ``zero_grad()``: the big batch's step in one micro-batch's
    memory (not faster; batch norm still sees micro-batches). ``(loss, num_items)`` weighs calls by items
    ("Fixing Gradient Accumulation", Hugging Face, 2024). A DDP ``model=`` runs non-boundary calls in
    ``no_sync()``; an FSDP2 one turns gradient sync off between boundaries. ``train_step.flush()`` (or
    ``train_step.epoch(loader)``) applies a short last window. Stepping the optimizer by hand while a window
    is open warns once.

    Sync points: none by default; one per optimizer step with ``skip_nonfinite=True``, an fp16 GradScaler, or
    a device-tensor ``num_items`` (is the window empty? A window of 0 items skips the optimizer step).
    State: ``.step``, ``.is_boundary``, ``.num_updates``, ``.pending``, ``.scaler``, ``.last_step_skipped``,
    ``.found_inf``, ``.micro_batch_size`` (None under ``"auto"`` until a call runs out of memory).
    Not thread-safe; cannot be pickled (a ``wrapt.FunctionWrapper``).

    Args:
        every: micro-steps per optimizer step (N >= 1).
        optimizer: the ``torch.optim.Optimizer`` holding the parameters.
        scheduler: stepped after each optimizer step that really happened (anything with ``.step()``).
        max_grad_norm: clip the total 2-norm of the normalised, unscaled gradients to this; None: no clipping.
        model: the model, needed when it is a ``DistributedDataParallel`` or an FSDP2 module.
        skip_nonfinite: skip (and warn about) a window whose loss or gradient is NaN/inf; one sync per step.
        micro_batch_size: split each call's tensors along dim 0 into micro-batches of at most this many rows,
            weighed exactly; ``"auto"``: whole batches, halved on out of memory (see ``micro_batching``).
        split: ``split(args, kwargs, size) -> [(args, kwargs), ...]`` for batches the dim-0 rule cannot split.
        enabled: False steps on every call (``every`` taken as 1), for A/B comparisons.

    Returns:
        A decorator. The step returns the detached 0-dim loss, ``(loss.detach(), num_items)``, or the
        step's mapping ``{"loss": ..., "num_items": ..., **extras}`` with its tensors detached.

    Raises:
        TypeError, ValueError: a bad argument; at call time (before any gradient is touched), a result that
            is not a scalar loss with a ``grad_fn``, or a bad ``num_items``.
        SpeedupsError: a call switches between a bare loss and ``(loss, num_items)``.

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
    every, max_grad_norm = check_arguments(
        every, optimizer, scheduler, max_grad_norm, model, skip_nonfinite, enabled, stacklevel=3
    )
    make_micro_batcher(micro_batch_size, split, grad_sync_for(model).kind, every)  # checked before decorating

    def decorator(fn: F) -> F:
        if isinstance(fn, type) or not callable(fn):
            what = fn.__name__ if isinstance(fn, type) else repr(fn)
            raise TypeError(
                f"accumulate({every!r}, optimizer)({what}): expected the step function (or method) that "
                f"returns the micro-batch loss; decorate `def train_step(x, y): return loss_fn(model(x), y)`."
            )
        acc = _Accumulator(
            every if enabled else 1, optimizer, scheduler, max_grad_norm, model, skip_nonfinite,
            micro_batch_size, split,
        )  # fmt: skip
        if enabled:  # a plain step on every call (enabled=False) owns no window to guard
            guard_optimizer(acc)
        return Step(fn, acc)  # type: ignore[return-value]

    return decorator

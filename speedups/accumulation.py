"""Tip 4: gradient accumulation that equals the big batch, at no extra cost per micro-step.

``@accumulate(N, optimizer)`` turns a function that returns a micro-batch loss into a training step: it runs
backward on every call and, on every N-th call (the boundary), normalises the accumulated gradients exactly,
unscales and clips them once, steps the optimizer (then the scheduler) and zeroes the gradients. Under DDP the
forward and backward of the other calls run inside ``no_sync()``, so there is one gradient all-reduce per
optimizer step.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import wrapt
from torch.nn.parallel import DistributedDataParallel

from speedups import _env, _step
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["accumulate"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_NULL = contextlib.nullcontext()
_MEAN, _ITEMS = "mean", "items"


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
    ) -> None:
        self.every = every
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.model = model
        self.scaler: torch.amp.GradScaler | None = None
        self.mode: str | None = None  # _MEAN or _ITEMS, fixed by the first call
        self.step = 0  # micro-steps so far
        self.num_updates = 0  # optimizer steps really taken
        self.pending = 0  # calls in the open window
        self.is_boundary = False
        self.last_step_skipped = False
        self.probe: torch.Tensor | None = None  # checked for finiteness at the last update
        self.losses: list[torch.Tensor] = []  # the open window's detached losses (single process)
        self.ref_n: Any = 1.0  # single process: the first item count of the window (>= 1)
        self.total_host = 0.0  # items of the open window given as Python numbers
        self.total_device: torch.Tensor | None = None  # ... and as tensors
        self.inv_every = 1.0 / every
        # Data parallelism, decided once. `averaged` is what the gradient sync divides by (DDP and FSDP2
        # average over the world size), `group` the process group for the item count.
        self.kind = "single"
        self.group: Any = None
        self.world = 1
        if isinstance(model, DistributedDataParallel):
            self.kind, self.group = "ddp", model.process_group
            self.world = dist.get_world_size(self.group)
        elif model is not None and callable(getattr(model, "set_requires_gradient_sync", None)):
            self.kind = "fsdp2"
            self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.sync_off = False  # FSDP2: gradient sync currently turned off
        self.single = self.kind == "single"
        self.skip_nonfinite = skip_nonfinite
        self.check_losses = skip_nonfinite and self.single

    # ------------------------------------------------------------------------------------------ call
    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        if self.scaler is None:
            if self.pending:
                raise SpeedupsError(
                    f"accumulate: a GradScaler arrived in the middle of an accumulation window "
                    f"({self.pending} unscaled micro-steps already accumulated). Enter mixed_precision in "
                    f"every call of the step, from the first one, e.g. stack @mixed_precision('fp16') under "
                    f"@accumulate."
                )
            self.scaler = scaler
        return self.scaler

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The wrapt wrapper: one micro-step."""
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        if self.kind == "fsdp2" and self.sync_off == boundary:
            self.model.set_requires_gradient_sync(boundary)  # type: ignore[union-attr,operator]
            self.sync_off = not boundary
        ctx = self.model.no_sync() if self.kind == "ddp" and not boundary else _NULL  # type: ignore[union-attr,operator]
        token = _step.current_step.set(self)
        checker = _step.active_checker.get()
        if checker is not None:  # only inside speedups.check(): tell it which optimizer we step
            checker.watch_accumulated(self.optimizer, self)
        try:
            with ctx:
                out = wrapped(*args, **kwargs)
                loss, n = self._parse(out)
                detached = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
                if self.check_losses:  # checked for NaN/inf at the boundary, in one go
                    self.losses.append(detached)
                work = None
                if n is None:
                    target = loss if self.every == 1 else loss * self.inv_every
                else:
                    if self.single:
                        # Relative to the window's first count, so that the backward's magnitude (and an fp16
                        # GradScaler's headroom) does not grow with the count; undone exactly at the boundary.
                        # Under DDP every rank must weigh alike, so the weight there is the count itself.
                        if self.pending == 0:
                            self.ref_n = _reference_count(n)
                        target = loss * (n / self.ref_n)
                    else:
                        target = loss * n
                    self._add_items(n)
                    if boundary and self.world > 1:
                        # The global item count, all-reduced while backward runs: the step's one extra
                        # collective, launched before DDP's bucket all-reduces on every rank (same order).
                        count = self._local_count(loss.device)
                        work = dist.all_reduce(count, group=self.group, async_op=True)
                        self.total_device, self.total_host = count, 0.0
                if self.scaler is not None:
                    target = self.scaler.scale(target)
                target.backward()
        finally:
            _step.current_step.reset(token)
        self.step += 1
        self.pending += 1
        if boundary:
            if work is not None:
                work.wait()
            self._update(synced=True)
        if n is None:
            return detached
        return detached, (n.detach() if isinstance(n, torch.Tensor) else n)

    def _parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        if (  # the common case, in as few checks as possible; grad_fn implies a floating dtype
            self.mode is _MEAN
            and type(out) is torch.Tensor
            and out.dim() == 0
            and out.grad_fn is not None
            and not out.is_complex()
        ):
            return out, None
        n = None
        loss = out
        if isinstance(out, tuple) and len(out) == 2:
            loss, n = out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"accumulate: the step returned {type(out).__name__} {_short(out)}: expected a scalar loss "
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
                if n.numel() != 1 or n.is_complex() or n.dtype == torch.bool:
                    raise ValueError(
                        f"accumulate: the step returned num_items of shape {tuple(n.shape)} and dtype "
                        f"{n.dtype}: expected a one-element real tensor or a number (items in the batch)."
                    )
            elif isinstance(n, bool) or not isinstance(n, numbers.Real):
                raise TypeError(
                    f"accumulate: the step returned num_items={n!r}: expected an int, a float or a "
                    f"one-element tensor. Return (loss, len(y)) or (loss, mask.sum())."
                )
            elif not (math.isfinite(float(n)) and float(n) >= 0):
                raise ValueError(
                    f"accumulate: the step returned num_items={n!r}: expected a finite count >= 0. "
                    f"Return (loss, len(y))."
                )
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
            n = n.detach().reshape(()).to(_count_dtype(n.device))
            self.total_device = n if self.total_device is None else self.total_device + n
        else:
            self.total_host += float(n)

    def _local_count(self, device: torch.device) -> torch.Tensor:
        if self.total_device is None:
            return torch.full((), self.total_host, dtype=_count_dtype(device), device=device)
        return self.total_device + self.total_host

    # ---------------------------------------------------------------------------------------- update
    def _factor(self, synced_by_wrapper: bool) -> float | torch.Tensor:
        """What the synchronised gradients must be multiplied by to be the window's exact mean."""
        averaged = self.world if synced_by_wrapper else 1  # DDP/FSDP2 divide by the world size
        if self.mode == _ITEMS:
            # A window of zero items (all padding) has nothing to learn from: its gradients are zeroed, never
            # divided by zero (an exact 0 count on the host also skips the optimizer step, see _update).
            if self.total_device is None:
                return averaged * self.ref_n / self.total_host if self.total_host else 0.0
            total = self.total_device + self.total_host
            return torch.where(total > 0, averaged * self.ref_n / total, torch.zeros_like(total)).float()
        return averaged * self.every / (self.world * self.pending)

    def _update(self, synced: bool) -> None:
        grads_synced_by_wrapper = synced and self.kind != "single"
        factor = self._factor(grads_synced_by_wrapper)
        if self.mode == _ITEMS and self.total_device is None and not self.total_host:
            warnings.warn(
                f"accumulate: the window ending at micro-step {self.step} holds 0 items (every num_items was "
                f"0): there is nothing to learn from it, so the optimizer step was skipped.",
                SpeedupsWarning,
                stacklevel=4,
            )
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_window()
            self.last_step_skipped = True
            return
        # Single process: the summed loss tells whether to skip (cheaper than a gradient norm). Data
        # parallel: the gradient norm, identical on every rank after the sync, so every rank decides alike.
        stepped, self.probe = _step.apply_update(
            self.optimizer,
            self.scaler,
            self.max_grad_norm,
            factor,
            skip_nonfinite=self.skip_nonfinite,
            probe=torch.stack(self.losses).sum() if self.check_losses and self.losses else None,
        )
        self.last_step_skipped = not stepped
        if stepped:
            self.num_updates += 1
            if self.scheduler is not None:
                self.scheduler.step()
        elif self.scaler is None:
            warnings.warn(
                f"accumulate: the gradients of the window ending at micro-step {self.step} are NaN or inf "
                f"(a non-finite loss, or an overflow): the optimizer step and the scheduler step were "
                f"skipped and the gradients dropped. Lower the learning rate or clip (max_grad_norm=1.0).",
                SpeedupsWarning,
                stacklevel=4,
            )
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_window()

    def _reset_window(self) -> None:
        self.pending = 0
        self.total_host = 0.0
        self.total_device = None
        self.losses = []
        self.ref_n = 1.0

    def flush(self) -> None:
        if not self.pending:
            return
        if self.kind == "fsdp2":
            raise SpeedupsError(
                f"accumulate(...).flush(): {self.pending} micro-steps are pending on an FSDP2 model whose "
                f"gradient sync was off; FSDP2 has no public way to reduce them afterwards. Make the epoch a "
                f"multiple of {self.every} micro-batches, e.g. DataLoader(..., drop_last=True)."
            )
        if self.kind == "ddp":
            self._all_reduce_pending()
        self._update(synced=False)

    def _all_reduce_pending(self) -> None:
        """Sum the gradients (and the item count) of a window whose calls all ran inside no_sync."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must send the same layout
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p in group:
                size = p.numel()
                grad = p.grad
                assert grad is not None
                grad.copy_(flat[offset : offset + size].view_as(grad))
                offset += size
        if self.mode == _ITEMS:
            device = params[0].device if params else torch.device("cpu")
            count = self._local_count(device)
            dist.all_reduce(count, group=self.group)
            self.total_device, self.total_host = count, 0.0

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        grads = [
            None if p.grad is None else p.grad.detach().clone()
            for g in self.optimizer.param_groups
            for p in g["params"]
        ]
        return {
            "every": self.every,
            "step": self.step,
            "num_updates": self.num_updates,
            "pending": self.pending,
            "mode": self.mode,
            "total_host": self.total_host,
            "total_device": None if self.total_device is None else self.total_device.clone(),
            "grads": grads if self.pending else None,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "losses": [loss.clone() for loss in self.losses],
            "ref_n": self.ref_n.clone() if isinstance(self.ref_n, torch.Tensor) else self.ref_n,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        call = "accumulate(...).load_state_dict(state)"
        keys = {"every", "step", "num_updates", "pending", "mode", "total_host", "total_device", "grads"}
        if not isinstance(state, dict) or not keys <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{call}: expected the dict of train_step.state_dict(), "
                f"with keys {sorted(keys | {'scaler', 'losses'})}, got {got}."
            )
        if state["every"] != self.every:
            raise ValueError(
                f"{call}: the checkpoint accumulated over "
                f"{state['every']!r} micro-steps, this step over {self.every}. Decorate with "
                f"accumulate({state['every']}, ...) to resume it."
            )
        # Everything is checked before anything changes: a bad checkpoint leaves the step and the gradients.
        for key in ("step", "num_updates", "pending"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{call}: state[{key!r}]={value!r}, expected an int >= 0.")
        if state["pending"] >= self.every:
            raise ValueError(f"{call}: state['pending']={state['pending']!r}, expected < every={self.every}.")
        if state["mode"] not in (None, _MEAN, _ITEMS):
            raise ValueError(
                f"{call}: state['mode']={state['mode']!r}, expected None, {_MEAN!r} or {_ITEMS!r}."
            )
        if isinstance(state["total_host"], bool) or not isinstance(state["total_host"], (int, float)):
            raise ValueError(f"{call}: state['total_host']={state['total_host']!r}, expected a number.")
        if state["total_device"] is not None and not isinstance(state["total_device"], torch.Tensor):
            raise ValueError(f"{call}: state['total_device'] must be None or a tensor.")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = state["grads"]
        if grads is not None:
            if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
                got_n = len(grads) if isinstance(grads, (list, tuple)) else type(grads).__name__
                raise ValueError(
                    f"{call}: the checkpoint holds gradients for {got_n} parameters, the optimizer has "
                    f"{len(params)}. Resume with the same model and optimizer."
                )
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape):
                    shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                    raise ValueError(
                        f"{call}: the gradient of parameter {i} has shape {shape}, the parameter "
                        f"{tuple(p.shape)}. Resume with the same model and optimizer."
                    )
        if state.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if grads is not None:
            for p, g in zip(params, grads, strict=True):
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
        self.step = state["step"]
        self.num_updates = state["num_updates"]
        self.pending = state["pending"]
        self.mode = {_MEAN: _MEAN, _ITEMS: _ITEMS}.get(state["mode"])  # the module's own string objects
        self.total_host = float(state["total_host"])
        self.total_device = state["total_device"]
        self.losses = list(state.get("losses", []))
        self.ref_n = state.get("ref_n", 1.0)
        self.sync_off = False
        if self.kind == "fsdp2":
            self.model.set_requires_gradient_sync(True)  # type: ignore[union-attr,operator]


def _reference_count(n: Any) -> Any:
    if isinstance(n, torch.Tensor):
        return n.detach().reshape(()).to(_count_dtype(n.device)).clamp_min(1.0)
    return max(float(n), 1.0)


def _count_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _short(value: object) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


class _StepAttributes:
    """The visible state of a decorated step, shared by the function and its bound methods."""

    def _acc(self) -> _Accumulator:
        raise NotImplementedError

    @property
    def step(self) -> int:
        """Micro-steps (calls) so far."""
        return self._acc().step

    @property
    def is_boundary(self) -> bool:
        """Whether the current call (inside the step) or the last call (after it) ends a window."""
        return self._acc().is_boundary

    @property
    def num_updates(self) -> int:
        """Optimizer steps really taken (skipped non-finite steps not counted)."""
        return self._acc().num_updates

    @property
    def pending(self) -> int:
        """Calls accumulated in the open window, not yet applied."""
        return self._acc().pending

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler adopted from ``mixed_precision("fp16")``, or None."""
        return self._acc().scaler

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped for inf/NaN gradients (a Python bool, no new sync)."""
        return self._acc().last_step_skipped

    @property
    def found_inf(self) -> torch.Tensor | None:
        """Whether the last update saw NaN/inf (loss or gradients): a 0-dim bool device tensor (no sync).

        None before the first update.
        """
        probe = self._acc().probe
        return None if probe is None else ~torch.isfinite(probe)

    def flush(self) -> None:
        """Apply the pending short window now, normalised by what it accumulated; no-op if none is pending.

        Call it at the end of every epoch (or iterate with :meth:`epoch`, which does). Under DDP every rank
        must call it: a pending window's gradients are all-reduced explicitly (one collective per dtype).
        """
        self._acc().flush()

    def epoch(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from ``batches`` and :meth:`flush` when they are exhausted: windows never straddle epochs.

        Raises:
            SpeedupsError: a window from an earlier epoch is still pending (a loop broke out early without
                ``flush()``).
        """
        acc = self._acc()
        if acc.pending:
            raise SpeedupsError(
                f"accumulate(...).epoch(loader): {acc.pending} micro-steps of an earlier epoch are still "
                f"pending. Call train_step.flush() before starting a new epoch."
            )
        yield from batches
        acc.flush()

    def state_dict(self) -> dict[str, Any]:
        """Return the step's state, with a copy of the pending gradients (and the adopted scaler's state).

        Save it with the model and optimizer: restoring all three mid-window gives the same weights as not
        stopping. Gradients are cloned: this costs one gradient's memory while the dict is alive.
        """
        return self._acc().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the pending gradients too).

        Raises:
            ValueError: ``state`` is not such a dict, or was made with another window size or model.
        """
        self._acc().load_state_dict(state)


class _BoundStep(_StepAttributes, wrapt.BoundFunctionWrapper):
    def _acc(self) -> _Accumulator:
        return self._self_parent._self_acc


class _Step(_StepAttributes, wrapt.FunctionWrapper, Generic[F]):
    __bound_function_wrapper__ = _BoundStep

    def __init__(self, wrapped: F, acc: _Accumulator) -> None:
        super().__init__(wrapped, acc)
        self._self_acc = acc

    def _acc(self) -> _Accumulator:
        return self._self_acc


def accumulate(
    every: int,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    model: torch.nn.Module | None = None,
    skip_nonfinite: bool = False,
    enabled: bool = True,
) -> Callable[[F], F]:
    """Turn a function that returns a micro-batch loss into a gradient-accumulation training step.

    The decorated function computes the loss of one micro-batch; the step runs backward on every call, and
    every ``every``-th call (the boundary) it applies the optimizer step: the accumulated gradients are
    normalised to the exact mean of the window, unscaled once (when a ``mixed_precision("fp16")`` context ran
    inside the step), clipped to ``max_grad_norm``, then ``optimizer.step()``, ``scheduler.step()`` and
    ``optimizer.zero_grad(set_to_none=True)``. The update equals one step on the concatenated window (the big
    batch) up to float rounding. It saves memory (a batch of ``every`` micro-batches in the memory of one); it
    does not make a step faster, and with batch norm the statistics are still per micro-batch.

    **Normalisation.** A bare loss weighs every call the same: the update is the mean over the calls actually
    accumulated (backward runs on ``loss / every``; a short window of ``k`` calls is rescaled by
    ``every / k`` when flushed). A ``(loss, num_items)`` return weighs by items (samples, non-padding
    tokens): backward runs on ``loss * num_items`` and the gradients are divided by the window's total count
    at the boundary, so micro-batches of 8, 8, 8 and 5 samples give the gradient of the mean over 29 samples.
    ``num_items`` may be a number or a one-element device tensor; nothing is read ahead from the loader.

    **Data parallelism.** With ``model=`` a ``DistributedDataParallel``, the forward and backward of every
    non-boundary call run inside ``model.no_sync()``: one gradient all-reduce per optimizer step. DDP averages
    over the world size; the step accounts for it, and with ``num_items`` divides by the global item count
    (one small all-reduce of the count per optimizer step, overlapped with the boundary's backward). With an
    FSDP2 module (one with ``set_requires_gradient_sync``), gradient sync is turned off between boundaries.
    Without ``model=``, a DDP model syncs on every call (correct for bare losses, but slower) and
    ``num_items`` is normalised per rank.

    **Epochs.** A short final window is applied by ``train_step.flush()``; ``for batch in
    train_step.epoch(loader):`` flushes by itself at the end of the loader, and raises if a window of an
    earlier epoch is still pending, so a window never silently straddles two epochs.

    **Non-finite losses.** By default nothing is checked, so the boundary needs no host-device sync: a NaN
    reaches the parameters as in a plain loop (``LossTracker`` counts and reports non-finite losses). With
    ``skip_nonfinite=True`` a window with a NaN/inf loss is skipped instead: no optimizer step, no scheduler
    step, its gradients dropped, one :class:`~speedups.SpeedupsWarning`, for one sync per optimizer step.
    Single process: the window's losses are
    checked. With clipping, or under DDP/FSDP2 (where every rank must decide alike), the gradient norm after
    the sync is checked, which also catches overflowing gradients. With an fp16 GradScaler, the scaler skips
    the step instead and lowers its scale, without a warning (that is how loss scaling calibrates);
    ``train_step.last_step_skipped`` says so.

    Sync points: none by default. With ``skip_nonfinite=True`` or an fp16 GradScaler, one host-device sync
    per optimizer step decides whether to skip it (the check above, or ``GradScaler.step``'s own).

    Visible state: ``train_step.step`` (calls so far), ``.is_boundary``, ``.num_updates``, ``.pending``,
    ``.scaler``, ``.last_step_skipped``, ``.found_inf``; ``.flush()``, ``.epoch(loader)``,
    ``.state_dict()``, ``.load_state_dict()``. Decorating a method works; the state belongs to the decorated
    function and is shared by all instances. A step is one training loop's: it is not thread-safe. The
    wrapped function (a ``wrapt.FunctionWrapper``) cannot be pickled.

    The technique is standard; the exact per-item normalisation follows the analysis in "Fixing Gradient
    Accumulation" (Hugging Face blog, 2024) of the bug where dividing by ``N`` mis-weights unequal windows.

    Args:
        every: micro-steps per optimizer step (N >= 1).
        optimizer: the ``torch.optim.Optimizer`` holding the parameters.
        scheduler: stepped once after each optimizer step that really happened (anything with ``.step()``).
        max_grad_norm: clip the total 2-norm of the normalised, unscaled gradients to this, once per
            optimizer step; None for no clipping.
        model: the model, needed when it is a ``DistributedDataParallel`` or an FSDP2 module.
        skip_nonfinite: skip (and warn about) a window whose loss or gradient is NaN/inf; costs one
            host-device sync per optimizer step. False (default): no check, no sync, as a plain loop.
        enabled: False behaves as a plain step on every call (``every`` taken as 1: backward, clip, optimizer
            step, scheduler step, zero grad), for A/B comparisons without changing the loop.

    Returns:
        A decorator. The decorated step returns the detached loss (a 0-dim tensor on the loss's device), or
        ``(loss.detach(), num_items)`` when the function returned ``(loss, num_items)``: exactly what
        ``LossTracker.update(loss, n)`` takes.

    Raises:
        TypeError: ``every`` is not an int, ``optimizer`` not an Optimizer, ``model`` not a Module,
            ``scheduler`` without ``step()``, ``max_grad_norm`` not a number; at call time, a step that
            returns no tensor.
        ValueError: ``every < 1``, ``max_grad_norm <= 0``; at call time, a non-scalar loss or one without
            ``grad_fn``, a bad ``num_items`` (raised before any gradient is touched).
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
        >>> train_step.flush()
        >>> train_step.num_updates, train_step.pending
        (3, 0)
    """
    said = f"accumulate({every!r}, optimizer, "
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(
            f"accumulate(every={every!r}): expected a positive int (micro-steps per optimizer step), got "
            f"{type(every).__name__}. Write e.g. accumulate(4, optimizer)."
        )
    if every < 1:
        raise ValueError(
            f"accumulate(every={every!r}): must be at least 1 (1 steps on every call). "
            f"Write e.g. accumulate(4, optimizer)."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"accumulate({every!r}, optimizer={_short(optimizer)}): expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}. Write accumulate({every}, torch.optim.SGD(model.parameters(), lr))."
        )
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"{said}scheduler={_short(scheduler)}): expected an LR scheduler with a step() method or "
            f"None, got {type(scheduler).__name__}."
        )
    max_grad_norm = _step.check_max_grad_norm(max_grad_norm, said)
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{said}model={_short(model)}): expected a torch.nn.Module (the DDP or FSDP2 model) or None, "
            f"got {type(model).__name__}."
        )
    for name, flag in (("skip_nonfinite", skip_nonfinite), ("enabled", enabled)):
        if not isinstance(flag, bool):
            raise TypeError(f"{said}{name}={flag!r}): expected True or False.")
    if model is None and _env.is_distributed() and _env.rank() == 0:
        warnings.warn(
            f"accumulate({every}, optimizer): this is a multi-process job but no model= was given, so the "
            f"step cannot use DDP's no_sync() between boundaries (every micro-step all-reduces) and "
            f"normalises num_items per rank. Pass it: accumulate({every}, optimizer, model=model).",
            SpeedupsWarning,
            stacklevel=2,
        )

    def decorator(fn: F) -> F:
        if isinstance(fn, type) or not callable(fn):
            what = fn.__name__ if isinstance(fn, type) else repr(fn)
            raise TypeError(
                f"accumulate({every!r}, optimizer)({what}): expected the step function (or method) that "
                f"returns the micro-batch loss; decorate `def train_step(x, y): return loss_fn(model(x), y)`."
            )
        acc = _Accumulator(
            every if enabled else 1, optimizer, scheduler, max_grad_norm, model, skip_nonfinite
        )
        return _Step(fn, acc)  # type: ignore[return-value]

    return decorator

"""The state of one ``@accumulate`` step, and everything it does with it: the accumulator.

Every call runs backward; every N-th call (the boundary) normalises the accumulated gradients exactly,
unscales and clips them once, steps the optimizer (then the scheduler) and zeroes the gradients. The
:class:`Accumulator` owns the position in the window, the item counts, the adopted GradScaler, the
checkpoint state (:meth:`Accumulator.state_dict`), the epoch logic (:meth:`Accumulator.epoch`) and the guard
on its optimizer. Two kinds of work are strategies it calls through small interfaces: how the gradients
reach the other ranks (:mod:`speedups.accumulation.grad_sync`, chosen once when decorating) and how one call
runs as micro-batches (:mod:`speedups.accumulation.micro_batching`).

A step restored before its first fp16 call has no GradScaler yet (``mixed_precision`` hands it over on that
call): the saved scaler state is kept and applied when the scaler arrives (:meth:`Accumulator.adopt_scaler`).
A restored window flushed before that call (a checkpoint taken after an epoch's last micro-step) is unscaled
by a stand-in GradScaler built from the saved state, whose state then passes to the real one.
"""

from __future__ import annotations

import enum
import functools
import inspect
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from speedups._helpers.compat import grad_version
from speedups._helpers.layout import LayoutChange
from speedups._helpers.step_context import apply_update, current_step, params_of
from speedups._helpers.validate import short
from speedups.accumulation.checks import (
    check_outer_autocast,
    check_result,
    check_state,
    refuse_reentry,
    warn_skipped,
)
from speedups.accumulation.grad_sync import GradSync, SyncKind, count_dtype
from speedups.accumulation.micro_batching import MicroBatcher
from speedups.accumulation.output import as_loss_and_items, result_of
from speedups.accumulation.ownership import OWNERSHIP
from speedups.accumulation.update_record import UpdateRecord
from speedups.accumulation.zero_items import GradMask, Keep, keep_of
from speedups.data.distributed_loader import DistributedLoader
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["Accumulator"]

T = TypeVar("T")


class _Mode(enum.Enum):
    """How the calls of a window are weighed, fixed by the first call: alike, or by their item count."""

    MEAN = "mean"
    ITEMS = "items"


_MEAN, _ITEMS = _Mode.MEAN, _Mode.ITEMS  # module globals: read on every call, faster than _Mode.MEAN


class Accumulator:
    """The state of one decorated step and its call path: the wrapt wrapper of ``@accumulate``.

    Attributes (read through the :class:`~speedups.accumulation.step.Step` the user holds):
        step: micro-steps so far. num_updates: optimizer steps really taken. pending: calls in the open
        window. is_boundary: whether the current (or last) call ends a window. scaler: the adopted
        GradScaler. last_step_skipped: whether the last update was skipped. probe: the 0-dim tensor whose
        finiteness the last update checked. micro: the micro-batching strategy, or None.
    """

    def __init__(
        self,
        every: int,
        optimizers: tuple[torch.optim.Optimizer, ...],
        schedulers: tuple[Any, ...],
        max_grad_norm: float | None,
        sync: GradSync,
        skip_nonfinite: bool,
        micro: MicroBatcher | None = None,
        *,
        model: torch.nn.Module | None = None,
        guard: bool = True,
        max_grad_value: float | None = None,
    ) -> None:
        self.every = every
        self.optimizers = optimizers
        self.schedulers = schedulers
        self.model = model  # its parameters' order is the gradient norm's order
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
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
        self.sync = sync  # data parallelism, decided once
        self.skip_nonfinite = skip_nonfinite
        # One process: the summed loss tells whether to skip (cheaper than a gradient norm). Data parallel:
        # the gradient norm, identical on every rank after the sync, so every rank decides alike.
        self.check_losses = skip_nonfinite and self.sync.kind is SyncKind.SINGLE
        self.updating = False  # True while this step runs its own optimizer update
        self.mask = GradMask()  # drops the gradients of zero-item micro-steps (see .zero_items)
        self.host_items = False  # this rank's open window counted items > 0 given as Python numbers
        self.warned: set[str] = set()  # what this step has warned about (each once; see _warn_once)
        self.micro = micro  # None: every call is one micro-step
        self.in_epoch = False  # True while an epoch() pass runs: a window then belongs to that pass
        self.closes_epoch = False  # the current call is the last of a sized epoch() pass (FSDP2 syncs it)
        self.resumed_in_epoch = False  # the restored window was saved inside an epoch() pass
        self.restored_scaler: dict[str, Any] | None = None  # a loaded scaler state, for the scaler to come
        self.stand_in = False  # the scaler is the step's own, built by a flush before mixed_precision's came
        # on_update hooks by handle id: an OrderedDict, as torch's (a RemovableHandle holds it weakly)
        self.hooks: OrderedDict[int, Callable[[UpdateRecord], Any]] = OrderedDict()
        self.before_hooks: OrderedDict[int, Callable[[list[torch.Tensor]], Any]] = OrderedDict()
        self.window_log: list[tuple[torch.Tensor, Any]] = []  # per call (loss or loss * items, items)
        self.last_grad_norm: torch.Tensor | None = None  # the total norm before clipping of the last update
        self.sentinel: torch.Tensor | None = None  # a parameter with a gradient in the open window
        self.feed: dict[str, int] | None = None  # the layout of the DistributedLoader epoch() iterates
        # The optimizers' parameters (and in the norm's order), made again only when a param group is added.
        self._params: tuple[list[tuple[int, int]], list[torch.Tensor], list[torch.Tensor], set[int]] = (
            [],
            [],
            [],
            set(),
        )
        self.clean_start = True  # the open window started with no gradient (see _drop_strays)
        self.noted_grad: torch.Tensor | None = None  # the sentinel's gradient after the step's last call
        self.noted_version = -1  # ... and its version counter (see _note_grad)
        self.watch_grads = sync.kind is not SyncKind.FSDP2  # FSDP2 holds the window's gradients itself
        self.last_sentinel: torch.Tensor | None = None  # the previous window's sentinel
        OWNERSHIP.add(self)
        self.calls_seen = OWNERSHIP.calls  # the calls of all steps after this step's last one
        if guard:  # a plain step on every call (enabled=False) owns no window to guard
            hook = functools.partial(_on_optimizer_step, weakref.ref(self))
            for optimizer in optimizers:
                handle = optimizer.register_step_pre_hook(hook)
                weakref.finalize(self, handle.remove).atexit = False

    # ------------------------------------------------------------------------------------------ call
    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        if self.scaler is None or self.stand_in:
            restored = self._handed_over()  # a state loaded before the scaler existed, if any
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
        if torch.compiler.is_compiling():  # dynamo traces this frame (a graph break led here): run eagerly
            return torch.compiler.disable(self.__call__)(wrapped, instance, args, kwargs)
        if current_step.get() is self:
            refuse_reentry(self.step, self.pending, self.every)
        sentinel = self.sentinel
        if sentinel is not None and self.pending:
            if sentinel.grad is None:  # zero_grad() by hand
                self._warn_zero_grad()
                self._note_grad()
            elif self.watch_grads and (  # a backward() outside the step, or a
                sentinel.grad is not self.noted_grad or grad_version(sentinel.grad) != self.noted_version
            ):
                self._warn_changed(inside=False)  # zero_grad(set_to_none=False): warned
        if not self.pending:  # a window starts: with no gradient this step did not make
            self._drop_strays()
        OWNERSHIP.calls = self.calls_seen = OWNERSHIP.calls + 1
        # Other steps' open windows (none in a one-step script: one comparison) are set aside while it runs.
        foreign = OWNERSHIP.foreign_to(self) if OWNERSHIP.open_count > (self.pending > 0) else ()
        if not foreign:
            return self._call(wrapped, args, kwargs)
        kept = [p.grad for p in foreign]  # set aside: what this call's backward leaves there is dropped
        for p in foreign:
            p.grad = None
        try:
            return self._call(wrapped, args, kwargs)
        finally:
            for p, grad in zip(foreign, kept, strict=True):
                p.grad = grad

    def _call(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One micro-step: the user's function, its backward and, at a boundary, the update."""
        if self.micro is not None:  # the call's batch split into micro-batches
            return self._call_micro(self.micro, wrapped, args, kwargs)
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        ctx = self.sync.micro_step(boundary or self.closes_epoch)
        token = current_step.set(self)
        try:
            with ctx:
                out = wrapped(*args, **kwargs)
                loss, n = self.parse(out)
                if self.pending == 0:  # once a window
                    if self.scaler is None:  # an outer autocast spans it
                        check_outer_autocast(loss.device.type)
                    if self._backward_ran_inside():
                        self._warn_changed(inside=True)
                elif self.watch_grads and self.sentinel is not None:  # a backward() inside the step?
                    grad = self.sentinel.grad
                    if grad is not self.noted_grad or (
                        grad is not None and grad_version(grad) != self.noted_version
                    ):
                        self._warn_changed(inside=True)
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
            current_step.reset(token)
        self.step += 1
        self.pending += 1
        if self.pending == 1 and not boundary:  # a window opens: other steps set it aside while they run
            OWNERSHIP.opened(self)
        if self.hooks:
            if n is None:
                self.window_log.append((detached, None))
            else:
                self._log_call(detached, n, keep)
        self._note_grad()  # the version checks compare with it
        if boundary:
            if work is not None:
                work.wait()
            self._update(synced=True, depth=2, before=True)  # here, _call, __call__
        return detached if type(out) is torch.Tensor else result_of(out, detached, n)

    def _call_micro(
        self, micro: MicroBatcher, wrapped: Callable[..., Any], args: Any, kwargs: dict[str, Any]
    ) -> Any:
        """One call of the step run as micro-batches by ``micro``, then the update at a boundary."""
        split = micro.pieces(args, kwargs)  # bad input raises here, before anything changes
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        token = current_step.set(self)
        try:
            loss, n, out = micro.run(self, wrapped, args, kwargs, split)
        finally:
            current_step.reset(token)
        if boundary and n is not None and self.sync.kind is SyncKind.FSDP2 and self.sync.world > 1:
            count = self._local_count(loss.device)  # the window's items on every rank (DDP sums at its flush)
            self.sync.reduce_count(count).wait()
            self.total_device, self.total_host = count, 0.0
        if self.check_losses:
            self.losses.append(loss)
        self.step += 1
        self.pending += 1
        if self.pending == 1 and not boundary:  # a window opens: other steps set it aside while they run
            OWNERSHIP.opened(self)
        if self.hooks:
            self._log_call(loss, n, keep_of(n) if n is not None else None)
        self._note_grad()  # the version checks compare with it
        if boundary:
            if self.sync.kind is SyncKind.DDP:
                self.flush()  # one all-reduce of the summed gradients (per dtype) and of the item count
            else:
                self._update(synced=True, depth=3)  # here, _call, then __call__
        return result_of(out, loss, n)

    # ------------------------------------------------------- what the micro-batcher uses (MicroBatchHost)
    def backward_micro(self, loss: torch.Tensor, n: Any, weight: float, *, first_piece: bool) -> Keep:
        """Weigh and run one micro-batch's backward; return which of its gradients count (see ``keep_of``).

        ``weight``: the micro-batch's share of the call's rows (a mean loss); ``first_piece``: the call's
        first micro-batch (with an empty window, its item count is the window's weight reference).
        """
        keep: Keep = None
        if first_piece and self.pending == 0 and self._backward_ran_inside():
            self._warn_changed(inside=True)
        if n is None:
            target, scale = loss, weight * self.inv_every
        else:
            (target, keep), scale = self._weigh_items(loss, n, first=self.pending == 0 and first_piece), 1.0
        if self.scaler is None:
            check_outer_autocast(loss.device.type)
        self._backward(target, keep, scale)
        return keep

    def piece_context(self, last: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch runs in: gradient sync only where its strategy needs it (FSDP2: the
        last micro-batch of a boundary call; DDP: never, the boundary call reduces once after them)."""
        return self.sync.piece_step(self.is_boundary or self.closes_epoch, last)

    def retry_allowed(self, backwards: int) -> bool:
        """Whether a call that ran out of memory may run again at a smaller size (see ``GradSync``)."""
        return self.sync.retry_allowed(backwards)

    def trainable(self) -> list[torch.Tensor]:
        """The optimizers' parameters, in optimizer then param-group order."""
        return self._parameters()[0]

    def _parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The optimizers' parameters in their order, and in the order the gradient norm sums them:
        ``model.parameters()``'s where ``model=`` was given (as ``clip_grad_norm_(model.parameters())``
        sums), the others after. Cached while no optimizer gains a param group."""
        shape = [(id(g["params"]), len(g["params"])) for opt in self.optimizers for g in opt.param_groups]
        if shape != self._params[0]:  # a param group added, or parameters added to (or taken from) one
            params = params_of(self.optimizers)
            if len(params) != sum(count for _, count in shape):
                raise SpeedupsError(
                    "accumulate: a parameter is now listed twice among the step's optimizers (a param "
                    "group edited in place with a parameter it or another of the step's optimizers already "
                    "holds?), so one update would step it twice. Add each parameter once: `new = [p for p in "
                    "backbone.parameters() if all(p is not q for q in group['params'])]`."
                )
            order = params
            ids = {id(p) for p in params}
            if self.model is not None:
                first = [p for p in self.model.parameters() if id(p) in ids]
                placed = {id(p) for p in first}
                order = first + [p for p in params if id(p) not in placed]
            if self.pending and self._params[0]:  # parameters joined in the middle of a window
                self._warn_joined([p for p in params if id(p) not in self._params[3] and p.grad is not None])
            self._params = (shape, params, order, ids)
            OWNERSHIP.changed()  # what other steps set aside while they run
        return self._params[1], self._params[2]

    def known_params(self) -> list[torch.Tensor]:
        """The optimizers' parameters as this step last read them (another step asks; nothing is checked)."""
        return self._params[1]

    def owned_ids(self) -> set[int]:
        """The ids of the optimizers' parameters (see :mod:`~speedups.accumulation.ownership`)."""
        self._parameters()
        return self._params[3]

    def window_counts(self) -> tuple[float, torch.Tensor | None, Any]:
        """The open window's item counts and weight reference."""
        return self.total_host, self.total_device, self.ref_n

    def restore_counts(self, snapshot: tuple[float, torch.Tensor | None, Any]) -> None:
        """Put back what :meth:`window_counts` returned."""
        self.total_host, self.total_device, self.ref_n = snapshot

    def drop_window(self) -> int:
        """Close the window without an update, as a failed update does: gradients to None, counters reset.

        Returns the calls dropped, the failing one included.
        """
        dropped = self.pending + 1
        self._zero_grad()
        self._reset_window()
        return dropped

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
            self.mask.backward(target, keep, self.trainable(), single=self.sync.kind is SyncKind.SINGLE)

    def parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        """Check a call's result; return ``(loss, num_items)`` (None for a bare loss).

        Raises:
            TypeError, ValueError: see :func:`~speedups.accumulation.checks.check_result`.
            SpeedupsError: the call switched between a bare loss and ``(loss, num_items)``.
        """
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

    def _update(self, synced: bool, depth: int = 1, *, before: bool = False) -> None:
        """Apply the window (see ``apply_update``). ``depth``: the frames between this call and the user's
        code, for the warnings (2 from ``_call``; 2 from ``flush``, through ``Step.flush`` or ``epoch``).
        ``before``: tell the gradient sync first (``GradSync.before_update``), as a boundary call does.
        """
        # Whatever fails below (the optimizer, the scheduler, a warning turned error), the window is closed:
        # its gradients are dropped and the counters say what really happened, then the error propagates.
        record = None
        try:
            self._parameters()  # a param group edited during the window is seen (and checked) here
            if before:
                self.sync.before_update(self.trainable)
            if self.mode == _ITEMS and not self._has_items():
                self.last_step_skipped = True
                warn_skipped(self.step, empty=True, stacklevel=depth + 3)
                return
            factor = self._factor(synced)
            lrs = [g["lr"] for opt in self.optimizers for g in opt.param_groups] if self.hooks else None
            self.updating = True  # the optimizer steps below are this step's own: its guard lets them pass
            try:
                stepped, self.last_grad_norm, self.probe = apply_update(
                    self.optimizers,
                    self.scaler,
                    self.max_grad_norm,
                    factor,
                    skip_nonfinite=self.skip_nonfinite,
                    params=self._norm_order,
                    probe=torch.stack(self.losses).sum() if self.check_losses and self.losses else None,
                    max_grad_value=self.max_grad_value,
                    before_step=self._before_step if self.before_hooks else None,
                )
            finally:
                self.updating = False
            self.last_step_skipped = not stepped
            if stepped:
                self.num_updates += 1
                for scheduler in self.schedulers:
                    scheduler.step()
                if lrs is not None:
                    record = self._record(lrs)
            elif self.scaler is None:
                clipping = self.max_grad_norm is not None
                warn_skipped(self.step, empty=False, stacklevel=depth + 3, clipping=clipping)
        finally:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self._reset_window()
        if record is not None:
            for hook in list(self.hooks.values()):
                hook(record)

    def _norm_order(self) -> list[torch.Tensor]:
        """The parameters in the order the gradient norm sums them (see :meth:`_parameters`)."""
        return self._parameters()[1]

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _reset_window(self) -> None:
        OWNERSHIP.closed(self)
        self.noted_grad, self.noted_version = None, -1  # holds no gradient the update let go
        if self.sentinel is not None:
            self.last_sentinel = self.sentinel
        self.pending = 0
        self.total_host = 0.0
        self.total_device = None
        self.host_items = False
        self.losses = []
        self.ref_n = 1.0
        self.window_log = []
        self.sentinel = None

    def _with_grad(self) -> torch.Tensor | None:
        """A parameter that has a gradient now (the zero_grad watch), or None. The parameters as last read:
        this window's start read them."""
        for p in self._params[1]:
            if p.grad is not None:
                return p
        return None

    # ------------------------------------------------------------------------------- per-update hooks
    def on_update(self, fn: Callable[[UpdateRecord], Any]) -> RemovableHandle:
        """Call ``fn(record)`` after every optimizer step really taken; return a removable handle."""
        if not callable(fn) or not _takes_one_argument(fn):
            raise TypeError(
                f"train_step.on_update({short(fn)}): expected a function of one argument, the "
                f"UpdateRecord. Write train_step.on_update(lambda record: ema.update_parameters(model))."
            )
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = fn
        return handle

    def before_update(self, fn: Callable[[list[torch.Tensor]], Any]) -> RemovableHandle:
        """Call ``fn(params)`` just before every optimizer step really taken; return a removable handle."""
        if not callable(fn) or not _takes_one_argument(fn):
            raise TypeError(
                f"train_step.before_update({short(fn)}): expected a function of one argument, the list of "
                f"parameters with gradients. Write train_step.before_update(lambda params: "
                f"torch.nn.utils.clip_grad_value_(params, 0.5))."
            )
        handle = RemovableHandle(self.before_hooks)
        self.before_hooks[handle.id] = fn
        return handle

    def _before_step(self) -> None:
        params = [p for p in self._norm_order() if p.grad is not None]
        for hook in list(self.before_hooks.values()):
            hook(params)

    def _log_call(self, loss: torch.Tensor, n: Any, keep: Keep) -> None:
        """Keep what the window's mean loss needs of this call: its loss (times its items), its items."""
        if n is None:
            self.window_log.append((loss, None))
        elif keep is False:
            self.window_log.append((torch.zeros_like(loss), n))
        else:
            n = n.detach() if isinstance(n, torch.Tensor) else n
            part = loss * n
            self.window_log.append((part if keep is None else torch.where(keep, part, 0.0), n))

    def _record(self, lrs: list[Any]) -> UpdateRecord:
        """The record of the update just taken (before the window is reset); its loss is made when read."""
        items: Any = None
        if self.mode is _ITEMS:
            items = self.total_host
            if self.total_device is not None:
                items = self.total_device if not self.total_host else self.total_device + self.total_host
        return UpdateRecord(
            self.step, self.num_updates, self.pending, items, self.last_grad_norm, lrs, self.window_log,
            self.mode is _ITEMS,
        )  # fmt: skip

    def flush(self) -> None:
        if not self.pending:
            return
        self._stand_in_scaler()  # a restored fp16 window flushed before any fp16 call
        local_count = self._local_count if self.mode is _ITEMS else None
        count = self.sync.sync_window(self.trainable(), local_count, self.pending, self.every)
        if count is not None:
            self.total_device, self.total_host = count, 0.0
        try:
            self._update(synced=self.sync.flush_averaged, depth=2)
        finally:
            self.sync.after_flush(self.trainable())
            if self.sync.zeroed:  # DDP's zero gradients: this step's own until its next update
                OWNERSHIP.opened(self)

    def epoch(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from ``batches`` and :meth:`flush` when they are exhausted (see ``Step.epoch``).

        Raises:
            SpeedupsError: a window of an earlier epoch is still pending (a loop broke out without flush()).
        """
        if self.pending:
            self._check_continues(batches)
        if isinstance(batches, DistributedLoader):  # which loader feeds this step (a resume on another
            layout = batches.state_dict()  # number of processes checks the global batch with it)
            self.feed = {k: layout[k] for k in ("batch_size", "samples", "world_size")}
        self.resumed_in_epoch = False
        self.in_epoch = True
        size = _length(batches) if self.sync.kind is SyncKind.FSDP2 else None
        try:
            for i, batch in enumerate(batches):
                self.closes_epoch = i + 1 == size  # its backward must sync: the flush below applies it
                yield batch
        finally:
            self.in_epoch = self.closes_epoch = False
        self.flush()

    def _check_continues(self, batches: Any) -> None:
        """Refuse to start ``epoch(batches)`` over a pending window unless it was restored from this epoch.

        A window saved inside ``epoch()`` belongs to that epoch; a :class:`DistributedLoader` restored with it
        resumes that epoch mid-way (at least ``pending`` batches in), which is what tells the two apart.
        """
        position = batches.state_dict() if isinstance(batches, DistributedLoader) else None
        if self.resumed_in_epoch and (position is None or position["batches"] >= self.pending):
            return
        where = ""
        if self.resumed_in_epoch and position is not None:
            where = (
                f" The checkpoint was taken inside an epoch, but the loader starts epoch {position['epoch']} "
                f"at batch {position['batches']}: load it with the checkpoint too (loader=loader) so it "
                f"resumes where the window was saved."
            )
        raise SpeedupsError(
            f"accumulate(...).epoch(loader): {self.pending} micro-steps of an earlier epoch are still "
            f"pending. Call train_step.flush() before starting a new epoch.{where}"
        )

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The step's state, with a copy of the open window's gradients (one gradient's memory) and scaler.

        Raises:
            SpeedupsError: an FSDP2 step in the middle of a window (its gradients sit unreduced in FSDP2's own
                buffers, which no public API reads): nothing of a checkpoint is written then.
        """
        if self.pending and self.sync.kind is SyncKind.FSDP2:
            raise SpeedupsError(
                f"accumulate(...).state_dict(): {self.pending} of {self.every} micro-steps of a window are "
                f"pending on an FSDP2 model, whose unreduced gradients no public API can read or restore, so "
                f"the checkpoint could not resume this window. Save at a boundary: `if train_step.pending == "
                f"0: save_checkpoint(...)` (or after train_step.epoch(loader) ends)."
            )
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.trainable()]
        return {
            "every": self.every,
            "step": self.step,
            "num_updates": self.num_updates,
            "pending": self.pending,
            "mode": None if self.mode is None else self.mode.value,
            "total_host": self.total_host,
            "total_device": None if self.total_device is None else self.total_device.clone(),
            "grads": grads if self.pending else None,
            "scaler": self.restored_scaler if self.scaler is None else self.scaler.state_dict(),
            "losses": [loss.clone() for loss in self.losses],
            "ref_n": self.ref_n.clone() if isinstance(self.ref_n, torch.Tensor) else self.ref_n,
            "in_epoch": bool(self.in_epoch and self.pending),  # the open window belongs to a running epoch()
            "log": [(x.clone(), n.clone() if isinstance(n, torch.Tensor) else n) for x, n in self.window_log],
            "feed": self.feed,
            "plan": None if self.micro is None else self.micro.plan_state(),
        }

    def check_state(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state`` (ValueError), changing nothing."""
        check_state(state, self.every, self.trainable(), tuple(mode.value for mode in _Mode))
        if self.micro is not None:
            self.micro.check_plan(state.get("plan"))
        scaler = state.get("scaler")
        is_scaler_state = isinstance(scaler, dict) and {"scale", "_growth_tracker"} <= set(scaler)
        if scaler is not None and not is_scaler_state:
            raise ValueError(
                "accumulate(...).load_state_dict(state): state['scaler'] is not a GradScaler state (a dict "
                "with 'scale' and '_growth_tracker'). Pass what train_step.state_dict() returned."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, after checking all of it (see :meth:`check_state`)."""
        self.check_state(state)  # before any change
        if state.get("scaler") is not None:
            if self.scaler is not None:
                self.scaler.load_state_dict(state["scaler"])
            else:  # the scaler arrives with the first fp16 call, which applies this (adopt_scaler)
                self.restored_scaler = dict(state["scaler"])
        grads = state["grads"]
        if grads is not None:
            for p, g in zip(self.trainable(), grads, strict=True):
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
        self.step = state["step"]
        self.num_updates = state["num_updates"]
        self.pending = state["pending"]
        self.mode = None if state["mode"] is None else _Mode(state["mode"])
        self.total_host = float(state["total_host"])
        self.host_items = self.total_host > 0  # items counted on the host: the window holds some, no sync
        self.total_device = state["total_device"]
        self.losses = list(state.get("losses", []))
        self.ref_n = state.get("ref_n", 1.0)
        self.resumed_in_epoch = bool(state.get("in_epoch", False)) and self.pending > 0
        self.window_log = list(state.get("log", []))
        self.feed = state.get("feed")
        if self.micro is not None:
            self.micro.take_plan(state.get("plan"))
        self.sentinel = None
        self.noted_grad, self.noted_version = None, -1
        (OWNERSHIP.opened if self.pending else OWNERSHIP.closed)(self)
        self.sync.restart()

    def merge_states(self, states: list[Any], change: LayoutChange) -> dict[str, Any]:
        """This rank's state from what every rank saved on another layout (see ``layout_change``).

        The open window's gradients are what the new layout's ranks would hold after ``change.pending``
        micro-steps of it: summed over the saved ranks and shared alike by the new ones, in the units this
        step accumulates in (mean losses: ``1/every`` each, averaged over the ranks by the sync; item
        counts: the items' summed gradient, with a weight reference of 1). The item count goes to rank 0.

        Raises:
            ValueError: a saved state is not a step's state, or was made for another model.
        """
        for state in states:
            every = state.get("every") if isinstance(state, dict) else None
            check_state(state, every if isinstance(every, int) else self.every, self.trainable(),
                        tuple(mode.value for mode in _Mode))  # fmt: skip
        first, rank, world = states[0], change.rank, change.world
        pending = first["pending"] if change.pending is None else change.pending
        items = first["mode"] == _ITEMS.value
        ref = first.get("ref_n", 1.0) if world == 1 and change.saved_world == 1 else 1.0
        grads = None
        if pending:
            if items:  # every sample's gradient summed: sum(ref_r * g_r), then shared by the new ranks
                weights = [float(s.get("ref_n", 1.0)) / (world * float(ref)) for s in states]
            else:  # mean losses: the ranks' mean, which each new rank holds (the sync averages it)
                weights = [1.0 / change.saved_world] * len(states)
            grads = [
                _weighted_sum([s["grads"][i] for s in states], weights) for i in range(len(first["grads"]))
            ]
        host = sum(float(s["total_host"]) for s in states) if rank == 0 else 0.0
        devices = [s["total_device"] for s in states if s["total_device"] is not None]
        device = None
        if devices:
            device = functools.reduce(torch.add, devices) if rank == 0 else torch.zeros_like(devices[0])
        return {
            **first,
            "every": self.every,
            "step": first["step"] if change.micro_steps is None else change.micro_steps,
            "pending": pending,
            "total_host": host,
            "total_device": device,
            "grads": grads,
            "losses": [x for s in states for x in s.get("losses", [])] if rank == 0 else [],
            "ref_n": ref,
            "log": _merged_log([s.get("log", []) for s in states], pending, items, rank) if pending else [],
            "feed": None,  # epoch(loader) says again which loader feeds it, in this layout
        }

    def _handed_over(self) -> dict[str, Any] | None:
        """The scaler state a newly arrived GradScaler must take: the stand-in's, or one loaded earlier."""
        if self.stand_in:
            assert self.scaler is not None
            return dict(self.scaler.state_dict())
        state, self.restored_scaler = self.restored_scaler, None
        return state

    def _stand_in_scaler(self) -> None:
        """Before a flush with a restored scaler state and no scaler yet: build one from that state."""
        if self.scaler is not None or self.restored_scaler is None:
            return
        device = next((p.device for p in self.trainable()), torch.device("cpu"))
        scaler = torch.amp.GradScaler(device.type)
        scaler.load_state_dict(self.restored_scaler)
        scaler.scale(torch.zeros((), device=device))  # builds its scale tensor from the loaded state (lazy)
        self.scaler, self.stand_in, self.restored_scaler = scaler, True, None

    # ------------------------------------------------------------------------------------------ guard
    def _drop_strays(self) -> None:
        """At a window's start: drop the gradients this step did not make, as ``optimizer.zero_grad()`` at
        the top of a hand-written loop drops them.

        When another step ran since this one's last call, its backward made them (a GAN's generator loss
        through D: see :mod:`~speedups.accumulation.ownership`), silently dropped; otherwise a
        ``backward()`` outside any step or a ``zero_grad(set_to_none=False)`` (zeros) did, warned once.
        One pass over the parameters per window.
        """
        zeroed = self.sync.zeroed  # DDP's zero gradients after a flush are this step's own
        strays = [p for p in self.trainable() if p.grad is not None and id(p) not in zeroed]
        self.clean_start = True
        if not strays:
            return
        shared = OWNERSHIP.in_open_windows(self)  # (rare) parameters shared with a step whose window is
        if shared:  # open hold that window's gradients: kept
            self.clean_start = not any(id(p) in shared for p in strays)
            strays = [p for p in strays if id(p) not in shared]
        for p in strays:
            p.grad = None
        if not strays or OWNERSHIP.calls != self.calls_seen:
            return
        self._warn_once(  # stacklevel 3: here, __call__ (wrapt's wrapper is C), the caller of the step
            "strays",
            f"accumulate: the window starting at micro-step {self.step + 1} found gradients on "
            f"{len(strays)} of the step's parameters that no step made: a `loss.backward()` outside the "
            f"step, or `zero_grad(set_to_none=False)`, left them. They were dropped, as "
            f"`optimizer.zero_grad()` at the top of a hand-written loop drops them. Fix: return every "
            f"loss from the step (`return main + aux`), and remove backward() and zero_grad() calls from "
            f"the loop.",
            stacklevel=3,
        )

    def _warn_joined(self, joined: list[torch.Tensor]) -> None:
        """Warn once: parameters joined the optimizers mid-window with gradients earlier calls left."""
        if not joined:
            return
        self._warn_once(  # stacklevel 4: here, _parameters, _call (or __call__), the caller of the step
            "joined",
            f"accumulate: {len(joined)} parameters joined the step's optimizers in the middle of a window "
            f"(after micro-step {self.step}, {self.pending} of {self.every} accumulated) with gradients "
            f"already on them: what every backward since they were last zeroed left, possibly more than "
            f"this window, counts in this update. Fix: add parameters at a boundary (`if "
            f"train_step.pending == 0:`), or keep them at requires_grad=False until they join.",
            stacklevel=4,
        )

    def _note_grad(self) -> None:
        """Remember the sentinel's gradient as it is now (its tensor and version counter), choosing the
        sentinel first when the window has none yet (its first call)."""
        sentinel = self.sentinel
        if sentinel is None:
            sentinel = self.sentinel = self._with_grad()
        grad = None if sentinel is None else sentinel.grad
        self.noted_grad, self.noted_version = grad, -1 if grad is None else grad_version(grad)

    def _warn_changed(self, *, inside: bool) -> None:
        """Warn once: the open window's gradients changed outside the step's own backward."""
        self._note_grad()
        if inside:
            what = (
                f"a backward() ran inside the step (micro-step {self.step + 1}) and added to the open "
                f"window's gradients, weighted 1 instead of 1/{self.every}"
                f"{' and without the fp16 loss scale' if self.scaler is not None else ''}"
            )
            fix = "return the sum instead: `aux.backward(); return main` becomes `return main + aux`"
        else:
            what = (
                f"the open window's gradients changed between the previous call of the step and this one "
                f"(micro-step {self.step + 1}): a backward() outside the step added to them (weighted 1, not "
                f"1/{self.every}), or `zero_grad(set_to_none=False)` zeroed them"
            )
            fix = "return every loss from the step, and remove backward() and zero_grad() calls from the loop"
        self._warn_once(  # stacklevel: here, the check, __call__ or _call, ..., the caller of the step
            "inner backward" if inside else "changed",
            f"accumulate: {what}, so the update is not the big batch's. Fix: {fix}.",
            stacklevel=4 if inside else 3,
        )

    def _backward_ran_inside(self) -> bool:
        """On a window's first call, before the step's backward: whether a ``backward()`` already ran (and
        is not yet warned about; see :meth:`_warn_changed`).

        The window started without gradients (:meth:`_drop_strays`), so any gradient now was made inside the
        step's function: weighted 1 instead of the window's share, and without the fp16 loss scale. It looks
        at the previous window's sentinel (one parameter, reached by every backward through the model the
        step trains); the first window, at every parameter.
        """
        if "inner backward" in self.warned or not self.clean_start:
            return False
        if self.every == 1 and self.scaler is None and self.mode is not _ITEMS:
            return False  # weighted 1 and unscaled is what the step's own backward does here: exact
        zeroed = self.sync.zeroed
        probe = self.last_sentinel
        if probe is not None:
            return probe.grad is not None and id(probe) not in zeroed
        return any(p.grad is not None and id(p) not in zeroed for p in self.trainable())

    def _warn_zero_grad(self) -> None:
        """Warn once: the open window's gradients were set to None by someone else (a zero_grad by hand)."""
        self._warn_once(  # stacklevel 3: here, __call__ (wrapt's wrapper is C), the caller of the step
            "zero_grad",
            f"accumulate: the gradients of the open accumulation window ({self.pending} of {self.every} "
            f"micro-steps) were set to None between the previous call of the step and this one (micro-step "
            f"{self.step + 1}): `optimizer.zero_grad()` or `model.zero_grad()` is still in the loop, so the "
            f"window lost what it had accumulated. Fix: remove the zero_grad() call; @accumulate zeroes "
            f"the gradients after each optimizer step.",
            stacklevel=3,
        )

    def warn_hand_step(self) -> None:
        """Warn once that the optimizer was stepped by hand while a window is open (not by this step)."""
        if self.updating or not self.pending:
            return
        self._warn_once(  # stacklevel 4: here, the hook, torch's step wrapper, the caller of optimizer.step()
            "hand step",
            f"accumulate: optimizer.step() was called by hand on an optimizer that @accumulate steps "
            f"(after micro-step {self.step}, {self.pending} of {self.every} of the window accumulated), "
            f"so it steps on micro-steps that should only accumulate. Fix: remove the `optimizer.step()` "
            f"(and `optimizer.zero_grad()`) from the loop; @accumulate steps once every {self.every} "
            f"calls and `train_step.flush()` applies a short last window.",
            stacklevel=4,
        )

    def _warn_once(self, key: str, message: str, *, stacklevel: int) -> None:
        """Warn ``message`` (a ``SpeedupsWarning``) the first time this step warns about ``key``.

        ``stacklevel`` counts as ``warnings.warn`` would from the caller (this frame is added here).
        """
        if key in self.warned:
            return
        self.warned.add(key)
        warnings.warn(message, SpeedupsWarning, stacklevel=stacklevel + 1)


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(record)`` binds (True when its signature cannot be read, as for some builtins)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _weighted_sum(grads: list[Any], weights: list[float]) -> torch.Tensor | None:
    """``sum(w * g)`` over the ranks' gradients of one parameter, in rank order; None if no rank had one."""
    total = None
    for g, w in zip(grads, weights, strict=True):
        if g is not None:
            part = g * w if w != 1.0 else g.clone()
            total = part if total is None else total + part
    return total


def _merged_log(logs: list[list[Any]], pending: int, items: bool, rank: int) -> list[tuple[Any, Any]]:
    """The window log (what ``UpdateRecord.loss`` averages) of ``pending`` calls merged from every rank's:
    the job's mean so far, as ``pending`` calls on every rank (mean losses), or its totals in rank 0's
    first call and zeros elsewhere (item counts), so the ranks' sums (``UpdateRecord.loss_totals``) count
    the saved calls once."""
    parts = [part for log in logs for part in log]
    if not parts or any(len(log) != len(logs[0]) for log in logs):
        return []  # no hook saw this window: records of it carry no loss, as after any late registration
    total = functools.reduce(torch.add, [torch.as_tensor(x) for x, _ in parts])
    if not items:
        mean = total / len(parts)
        return [(mean, None)] * pending
    count = functools.reduce(lambda a, b: a + b, [n for _, n in parts])
    zero = (torch.zeros_like(total), count * 0)
    return ([(total, count)] if rank == 0 else [zero]) + [zero] * (pending - 1)


def _length(batches: Any) -> int | None:
    """``len(batches)``, or None for an iterable without a length (a generator, an iterable dataset's)."""
    try:
        return len(batches)
    except TypeError:
        return None


def _on_optimizer_step(owner: weakref.ref[Accumulator], optimizer: Any, args: Any, kwargs: Any) -> None:
    """The optimizer's step pre-hook: it holds the step weakly and goes when the step is collected."""
    acc = owner()
    if acc is not None and not acc.updating:  # the step's own update: nothing to check
        acc.warn_hand_step()

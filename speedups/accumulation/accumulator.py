"""One ``@accumulate`` step's call path: every call runs backward, every N-th applies the window.

The :class:`Accumulator` is the wrapt wrapper of a decorated step. It counts micro-steps and windows and
runs each call; the rest belongs to objects it holds, each in a file of its own: the open window's weighing
and counts (:mod:`.window`), the optimizer update with its GradScaler and hooks (:mod:`.update`), the checks
against gradients the step did not make (:mod:`.guard`), the parameters (:mod:`.parameters`), the
checkpoint state's checks and merge (:mod:`.state`), the ``epoch()`` passes (:mod:`.epoch_pass`), the
micro-batcher's view of the step (:mod:`.micro_host`). Two more are strategies chosen once when decorating:
how the gradients reach the other ranks (:mod:`.grad_sync`) and how one call runs as micro-batches
(:mod:`.micro_batching`).

:meth:`Accumulator.__call__` is the whole per-call path of the common case (one process, a bare mean loss,
no GradScaler, no micro-batching, no other step's window open): the user's function, one backward weighted
``1/every``, the counters, the update at the boundary. It costs a few attribute reads over a minimal
decorator: what is rare is checked once per window, on the window's first call (stray gradients, an outer
fp16 autocast, a backward inside that call), or read from what the call touches anyway (the sentinel
gradient's version). Every other case takes :meth:`Accumulator._call`, the long path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from speedups._helpers import compat
from speedups._helpers.notes import add_note
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups._helpers.step_context import current_step
from speedups.accumulation.checks import check_outer_autocast, refuse_freed_graph, refuse_reentry
from speedups.accumulation.epoch_pass import EpochPass
from speedups.accumulation.grad_sync import GradSync, SyncKind
from speedups.accumulation.grad_sync.fsdp2 import FSDP2Sync
from speedups.accumulation.guard import Guard
from speedups.accumulation.micro_batching import MicroBatcher
from speedups.accumulation.micro_host import MicroHost
from speedups.accumulation.output import result_of
from speedups.accumulation.ownership import OWNERSHIP
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.replay import PendingCalls
from speedups.accumulation.state import check_step_state, load_step_state, merge_states, step_state
from speedups.accumulation.update import Update
from speedups.accumulation.window import ITEMS, MEAN, Window
from speedups.accumulation.zero_items import Keep, keep_of
from speedups.errors import SpeedupsError

__all__ = ["Accumulator"]

T = TypeVar("T")


class Accumulator:
    """The call path and counters of one decorated step (the wrapt wrapper of ``@accumulate``).

    Attributes (read through the :class:`~speedups.accumulation.step.Step` the user holds):
        step: micro-steps so far. pending: calls in the open window. is_boundary: whether the current (or
        last) call ends a window. micro: the micro-batching strategy, or None. updater: the update (its
        ``num_updates``, ``scaler``, ``last_step_skipped``, ``probe``, ``last_grad_norm``, hooks).
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
        # The user's function and what wrapt wraps (``Step``'s body, which torch.compile traces): the short
        # path calls the function itself when wrapt hands it the body unbound (not a method's call).
        self.fn: Callable[..., Any] = _unset
        self.body: Callable[..., Any] = _unset
        self.sync = sync  # data parallelism, decided once
        self.micro = micro  # None: every call is one micro-step
        self.step = 0  # micro-steps so far
        self.pending = 0  # calls in the open window
        self.is_boundary = False
        # One process: the summed loss tells whether to skip (cheaper than a gradient norm). Data parallel:
        # the gradient norm, identical on every rank after the sync, so every rank decides alike.
        self.params = StepParameters(optimizers, model, self._params_changed)
        checks = skip_nonfinite and sync.kind is SyncKind.SINGLE
        self.window = Window(every, sync, self.params, check_losses=checks)
        self.updater = Update(
            self.params, schedulers, max_grad_norm=max_grad_norm, max_grad_value=max_grad_value,
            skip_nonfinite=skip_nonfinite,
        )  # fmt: skip
        self.alone = True  # the process's only live step (OWNERSHIP says, through the guard: see company)
        self.guard = Guard(self, self.params, sync, self.updater, self.window, hooks=guard)
        self.host = MicroHost(self)  # what the micro-batcher uses of this step
        self.passes = EpochPass(sized=sync.kind is SyncKind.FSDP2)  # train_step.epoch(loader)
        # FSDP2: the open window's calls, which a checkpoint taken mid-window saves to make them again
        self.replay = PendingCalls(sync.model) if isinstance(sync, FSDP2Sync) else None
        self.short = False  # whether a call may take the short path (see _short_allowed)
        self.inv_every = 1.0 / every  # a bare mean loss's weight
        self.hooks = self.updater.hooks  # the on_update hooks (the update's dict, read on every call)
        self.sync_before = type(sync).before_update is not GradSync.before_update  # data parallel only
        self.compile_checks = not _left_to_eager()  # an older torch: each call asks whether it is traced

    def wraps(self, fn: Callable[..., Any], body: Callable[..., Any]) -> None:
        """The step wraps ``body``, which calls the user's ``fn`` (see :class:`~.step.Step`)."""
        self.fn, self.body = fn, body

    # ------------------------------------------------------------------------------ the call path
    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The wrapt wrapper: one micro-step. The common case whole; any other in :meth:`_call`."""
        pending = self.pending
        if not (self.short and (self.alone or OWNERSHIP.open_count == (1 if pending else 0))):
            return self._call(wrapped, instance, args, kwargs)  # (with company: another window is open)
        guard = self.guard
        token = current_step.set(self)  # mixed_precision entered in the call finds the step
        try:
            if token.old_value is self:
                refuse_reentry(self.step, pending, self.every)
            if pending:
                guard.between_calls()  # a backward() or zero_grad() by hand since the last call?
            else:
                guard.start_window()  # once a window: drop gradients no step made
            if not self.alone:
                OWNERSHIP.last = guard.token
            self.is_boundary = boundary = pending + 1 == self.every
            out = (self.fn if wrapped is self.body else wrapped)(*args, **kwargs)
            if type(out) is not torch.Tensor or out.dim() or out.grad_fn is None or out.is_complex():
                done = self._backward_of(out, boundary)  # another form, or a bad result: checked there
            else:
                done = None
                if not pending:  # once a window: an outer fp16 autocast, a backward() inside the step
                    check_outer_autocast(out.device.type)
                    guard.first_call()
                try:
                    out.backward(torch.full_like(out, self.inv_every))  # what (loss / every).backward() sends
                except BaseException as err:  # a loss.backward() left in the step: the fix; else a Ctrl-C
                    self._backward_failed(err)  # or an error half-way: the window is dropped
                    raise
                guard.noted_after()  # and a backward() inside the step, found by the version it added
        finally:
            current_step.reset(token)
        if done is not None:
            return self._complete(out, boundary, *done)
        self.step += 1
        self.pending = pending + 1
        detached = out.detach()
        if self.hooks:
            self.window.log_call(detached, None, None)
        if boundary:
            self._update(synced=True, before=True)
        elif not pending:
            guard.window_opens()
        return detached

    def _call(self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """One micro-step, any case: a window's first call (its once-per-window checks), item counts, a
        GradScaler, micro-batches, data parallel, another step's window set aside while this one runs."""
        if self.compile_checks and torch.compiler.is_compiling():  # traced by dynamo: run as it is
            return torch.compiler.disable(self._call)(wrapped, instance, args, kwargs)
        if current_step.get() is self:
            refuse_reentry(self.step, self.pending, self.every)
        if self.replay is not None and self.replay.due is not None:  # a checkpoint's window, made again
            self._replay(wrapped, instance)
        guard = self.guard
        if OWNERSHIP.open_count > (self.pending > 0):  # another step's window is open: not on our optimizer
            guard.refuse_shared_optimizer()
        if self.pending:
            guard.between_calls()
        else:  # a window starts: with no gradient this step did not make
            guard.start_window()
        guard.call_starts()
        run = self._call_micro if self.micro is not None else self._call_one
        # Other steps' open windows (none in a one-step script: one comparison) are set aside while it runs.
        foreign = OWNERSHIP.foreign_to(guard) if OWNERSHIP.open_count > (self.pending > 0) else ()
        replay = self.replay
        rng = None
        try:
            if replay is not None:  # FSDP2: keep what the call starts from (see PendingCalls)
                rng = replay.before(first=not self.pending)
            if not foreign:
                out = run(wrapped, args, kwargs)
            else:
                kept = [p.grad for p in foreign]  # set aside: what this call's backward leaves is dropped
                for p in foreign:
                    p.grad = None
                try:
                    out = run(wrapped, args, kwargs)
                finally:
                    for p, grad in zip(foreign, kept, strict=True):
                        p.grad = grad
            if replay is not None and rng is not None:
                replay.after(rng, args, kwargs, self.passes.closes, self.pending)
            return out
        finally:
            self.short = self._short_allowed()

    def _replay(self, wrapped: Callable[..., Any], instance: Any) -> None:
        """Run again the pending calls a checkpoint saved (FSDP2: see :mod:`.replay`), from their inputs, RNG
        states and the window's buffers (the calls leave the buffers, counts and log as they left them the
        first time), then put back the RNG states loaded with them.

        Raises:
            SpeedupsError: a call failed when run again (the window is dropped; the error is its cause).
        """
        assert self.replay is not None
        calls, buffers = self.replay.take()
        step, pending = self.step, self.pending
        rng = get_rng_states()
        self.replay.put_buffers(buffers)
        closes = self.passes.closes
        self.step, self.pending = step - pending, 0
        self.window.reset()
        self.sync.restart(0)
        try:
            for args, kwargs, states, synced in calls:
                set_rng_states(states)
                self.passes.closes = synced
                self._call(wrapped, instance, args, kwargs)
        except BaseException as err:
            self.drop_window()
            if not isinstance(err, Exception):  # a Ctrl-C: as it is
                raise
            raise SpeedupsError(
                f"accumulate(...): running again the {pending} micro-steps pending in the checkpoint's "
                f"window failed ({type(err).__name__}: {err}); the window was dropped. Call the step with "
                f"the same function and model it was saved with."
            ) from err
        finally:
            self.passes.closes = closes
            set_rng_states(rng)
        if (self.step, self.pending) != (step, pending):  # a call did not count: never, but never silently
            raise SpeedupsError(
                f"accumulate(...): running the pending micro-steps again ended at micro-step {self.step} "
                f"({self.pending} pending), not {step} ({pending})."
            )

    def _short_allowed(self) -> bool:
        """Whether the next calls may take the short path of :meth:`__call__`."""
        return (
            self.every > 1
            and self.micro is None
            and not self.compile_checks
            and self.sync.kind is SyncKind.SINGLE
            and self.window.mode is MEAN
            and not self.window.check_losses
            and self.updater.scaler is None
            and not self.passes.closes
        )

    def _call_one(self, wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One micro-step of one piece: the user's function, its backward, the update at a boundary."""
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        ctx = self.sync.micro_step(boundary or self.passes.closes)
        token = current_step.set(self)
        try:
            with ctx:
                out = wrapped(*args, **kwargs)
                done = self._backward_of(out, boundary)
        finally:
            current_step.reset(token)
        return self._complete(out, boundary, *done)

    def _backward_of(self, out: Any, boundary: bool) -> tuple[torch.Tensor, Any, Keep, Any]:
        """Check the call's result, weigh it and run its backward.

        Returns ``(detached loss, num_items, keep, work)``: ``work`` is the item count's all-reduce in
        flight (a boundary call of several ranks), or None.
        """
        window = self.window
        loss, n = window.parse(out)
        first = self.pending == 0
        if first:  # once a window
            if self.updater.scaler is None:  # an outer autocast spans it
                check_outer_autocast(loss.device.type)
            self.guard.first_call()
        else:
            self.guard.inside_call()
        detached = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
        work = None
        keep: Keep = None  # None: every gradient of this call counts
        if n is None:
            target, weight = loss, window.inv_every
        else:
            (target, keep), weight = window.weigh_items(loss, n, first=first), 1.0
            if boundary and self.sync.world > 1 and not self.sync.boundary_flushes:
                # The global item count, all-reduced while backward runs: the step's one extra collective,
                # launched before DDP's bucket all-reduces on every rank (the same order).
                count = window.local_count(loss.device)
                work = self.sync.reduce_count(count)
                window.set_count(count)
        if window.check_losses:  # checked for NaN/inf at the boundary, in one go
            window.keep_loss(detached, keep)
        try:
            self.window.backward(target, keep, weight, self.updater.scaler)
        except BaseException as err:
            self._backward_failed(err)
            raise
        return detached, n, keep, work

    def _backward_failed(self, err: BaseException) -> None:
        """The call's own backward raised: the fix for a ``loss.backward()`` left in the step (it freed the
        graph before any gradient was added); otherwise (a Ctrl-C, out of memory, an error in a hook) part of
        the call's gradients may be in the window already, so the window is dropped, and a note says so.

        Raises:
            SpeedupsError: the graph had been freed by a backward inside the step.
        """
        if isinstance(err, RuntimeError):
            refuse_freed_graph(err, self.step)
        dropped = self.drop_window()
        add_note(
            err,
            f"speedups.accumulate: the step's backward stopped part-way (micro-step {self.step + 1}), after "
            f"some of its gradients may have been added to the window, so the open accumulation window "
            f"({dropped} call(s) with this one) was dropped: gradients set to None, train_step.pending is 0. "
            f"Nothing was stepped.",
        )

    def _complete(
        self, out: Any, boundary: bool, detached: torch.Tensor, n: Any, keep: Keep, work: Any
    ) -> Any:
        """Count the call whose backward ran; apply the window at a boundary; return what the call returns."""
        self._counted(boundary)
        if self.hooks:
            self.window.log_call(detached, n, keep)
        self.guard.note()  # the version checks compare with it
        if boundary:
            if work is not None:
                work.wait()
            if self.sync.boundary_flushes:  # gradients DDP did not see made: reduced from themselves
                self.flush()
            else:
                self._update(synced=True, before=True)
        return detached if type(out) is torch.Tensor else result_of(out, detached, n)

    def _counted(self, boundary: bool) -> None:
        """Count the call; a window that opens (and stays open) is set aside by other steps while they run."""
        self.step += 1
        self.pending += 1
        if self.pending == 1 and not boundary:
            self.guard.window_opens()

    def _call_micro(self, wrapped: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """One call of the step run as micro-batches by the micro-batcher, then the update at a boundary."""
        micro = self.micro
        assert micro is not None
        split = micro.pieces(args, kwargs)  # bad input raises here, before anything changes
        boundary = self.pending + 1 >= self.every
        self.is_boundary = boundary
        self.sync.split_call_starts(boundary or self.passes.closes)
        token = current_step.set(self)
        try:
            loss, n, out = micro.run(self.host, wrapped, args, kwargs, split)
        finally:
            current_step.reset(token)
        window = self.window
        if boundary and n is not None and self.sync.kind is SyncKind.FSDP2 and self.sync.world > 1:
            count = window.local_count(loss.device)  # the window's items on every rank (DDP: at its flush)
            self.sync.reduce_count(count).wait()
            window.set_count(count)
        if window.check_losses:
            window.keep_loss(loss, None)
        self._counted(boundary)
        if self.updater.hooks:
            window.log_call(loss, n, keep_of(n) if n is not None else None)
        self.guard.note()
        if boundary:
            if self.sync.kind is SyncKind.DDP:
                self.flush()  # one all-reduce of the summed gradients (per dtype) and of the item count
            else:
                self._update(synced=True)
        return result_of(out, loss, n)

    # ---------------------------------------------------------------------------------------- update
    def drop_window(self) -> int:
        """Close the window without an update, as a failed update does: gradients to None, counters reset.

        Returns the calls dropped, the failing one included.
        """
        dropped = self.pending + 1
        self.updater.zero_grad()
        self._close_window()
        return dropped

    def discard(self) -> int:
        """Drop the open window without an update (see ``Step.discard``); return the calls it held."""
        dropped = self.pending
        if dropped:
            self.sync.check_discard(dropped, self.every)  # before anything changes
            self.updater.zero_grad()
            self._close_window()
            self.sync.restart()
        return dropped

    def retire(self) -> None:
        """The user's handle on the step is gone: it leaves the registry of live steps and stops watching
        its optimizers (an open window it leaves is dropped by the next step that starts one there)."""
        self.guard.retire()

    def _update(self, *, synced: bool, before: bool = False) -> None:
        """Apply the window; ``before``: tell the gradient sync first (``GradSync.before_update``), as a
        boundary call does. Whatever fails (the optimizer, the scheduler, a warning turned error), the window
        is closed: its gradients are dropped and the counters say what really happened, then it propagates.
        """
        record = None
        try:
            self.params.all()  # a param group edited during the window is seen (and checked) here
            if before and self.sync_before:
                self.sync.before_update(self.params.all)
            record = self.updater.apply(self.window, self.step, self.pending, synced)
        finally:
            self.updater.zero_grad()
            self._close_window()
        if record is not None:
            self.updater.after(record)

    def _close_window(self) -> None:
        self.guard.close_window()
        if self.replay is not None:
            self.replay.clear()
        self.pending = 0
        self.window.reset()

    def _params_changed(self, previous: set[int], params: list[torch.Tensor]) -> None:
        self.guard.params_changed(previous, params)

    def company(self, alone: bool) -> None:
        """Whether this is the process's only live step. With company, the short path also stores the
        step's token in ``OWNERSHIP.last`` and is taken only while no other step's window is open."""
        self.alone = alone

    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        """Take the GradScaler of a ``mixed_precision("fp16")`` entered in the call (see ``ScalerSink``)."""
        self.short = False
        return self.updater.adopt_scaler(scaler, self.pending)

    def flush(self) -> None:
        """Apply the open window now, normalised by what it accumulated (see ``Step.flush``)."""
        if not self.pending:
            return
        if self.replay is not None and self.replay.due is not None:  # a checkpoint's window, made again
            self._replay(self.body, None)
        self.updater.stand_in_scaler()  # a restored fp16 window flushed before any fp16 call
        local_count = self.window.local_count if self.window.mode is ITEMS else None
        count = self.sync.sync_window(self.params.all(), local_count, self.pending, self.every)
        if count is not None:
            self.window.set_count(count)
        try:
            self._update(synced=self.sync.flush_averaged)
        finally:
            self.sync.after_flush(self.params.all())
            if self.sync.zeroed:  # DDP's zero gradients: this step's own until its next update
                self.guard.window_opens()

    def epoch(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from ``batches`` and :meth:`flush` when they are exhausted (see :class:`.EpochPass`)."""
        return self.passes.run(batches, self.pending, self.flush)

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The step's checkpoint state (see :func:`.state.step_state`)."""
        return step_state(self)

    def check_state(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state`` (ValueError), changing nothing."""
        check_step_state(state, self.every, self.params.all(), self.micro, self.replay)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, after checking all of it (see :meth:`check_state`)."""
        self.check_state(state)  # before any change
        load_step_state(self, state)

    def resume_at(self, step: int, pending: int) -> None:
        """A checkpoint's counters: ``step`` micro-steps so far, ``pending`` of them in the open window."""
        self.step, self.pending = step, pending
        self.short = False  # the next call takes the long path and decides again

    def merge_states(self, states: list[Any], change: Any) -> dict[str, Any]:
        """This rank's state from what every rank saved on another layout (:func:`.state.merge_states`)."""
        return merge_states(states, change, self.every, self.params.all())


_EAGER: list[bool] = []  # whether torch.compile runs a step's frames as they are (decided once)


def _left_to_eager() -> bool:
    """Have ``torch.compile`` run every frame below a step's call eagerly, as ``torch.compiler.disable``
    would, at no cost per call (:func:`~speedups._helpers.compat.eager_below`); once per process. A
    compiled function that calls the step graph-breaks there and the step runs as it does eagerly (its
    function's forward too). False on a torch without that strategy."""
    if not _EAGER:
        _EAGER.append(compat.eager_below(Accumulator.__call__))
    return _EAGER[0]


def _unset(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("Accumulator.wraps() was not called")

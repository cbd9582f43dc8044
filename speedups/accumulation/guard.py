"""What guards one ``@accumulate`` step's window against gradients it did not make, and the warnings it gives.

A window must hold exactly the gradients of the step's own backwards, weighted as the step weighs them. It
can go wrong in ways a hand-written loop hides: a ``loss.backward()`` left outside the step or inside it
(weighted 1, not 1/N), ``zero_grad()`` left in the loop, ``optimizer.step()`` called by hand, another step's
backward reaching this step's parameters (a GAN's generator loss through the discriminator), parameters
joining the optimizers mid-window. The :class:`Guard` catches each, at the cost of a few attribute reads
per call: it watches one parameter (the sentinel) whose gradient's identity and version counter tell whether
anything but the step's own backward touched the window, and does the rest once per window.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import itertools
import warnings
import weakref
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from speedups._helpers.callers import user_stacklevel
from speedups._helpers.compat import grad_version
from speedups._helpers.wrappers import live_wrapper_of
from speedups.accumulation.grad_sync import GradSync, SyncKind
from speedups.accumulation.ownership import OWNERSHIP
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.update import Update
from speedups.accumulation.window import ITEMS, Window
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["Guard"]

_tokens = itertools.count(1)


class _Watched(Protocol):
    """What the guard reads of the step it watches (for its checks and messages)."""

    every: int
    step: int
    pending: int

    def company(self, alone: bool) -> None: ...


class Guard:
    """The checks of one step's window; each mistake is warned once per step (a ``SpeedupsWarning``).

    Each warning points at the user's line (the nearest frame outside speedups and torch).

    Attributes:
        sentinel: a parameter with a gradient in the open window (None before its first backward).
        token: this step's mark in :data:`~speedups.accumulation.ownership.OWNERSHIP`'s ``last``.
    """

    def __init__(
        self, owner: _Watched, params: StepParameters, sync: GradSync, updater: Update, window: Window,
        *, hooks: bool,
    ) -> None:  # fmt: skip
        self.owner = owner
        self.params = params
        self.sync = sync
        self.updater = updater  # read: its scaler and whether it is stepping the optimizers
        self.window = window  # read: whether the window weighs its calls by item counts
        self.watch = sync.kind is not SyncKind.FSDP2  # FSDP2 holds the window's gradients itself
        self.warned: set[str] = set()
        self.sentinel: torch.Tensor | None = None
        self.noted_grad: torch.Tensor | None = None  # the sentinel's gradient after the step's last backward
        self.noted_version = -1  # ... and its version counter
        self.last_sentinel: torch.Tensor | None = None  # the previous window's sentinel
        self.clean_start = True  # the open window started with no gradient (see start_window)
        self.token = next(_tokens)
        self.ran = False  # a call of the step ran
        self.born_after = OWNERSHIP.last  # the step that ran last when this one was made
        self.alone = True  # the process's only live step (OWNERSHIP says: see set_alone)
        self.retired = False  # the user's handle on the step is gone (see retire)
        self._handles: list[Any] = []
        OWNERSHIP.add(self)
        if hooks:  # a plain step on every call (enabled=False) owns no window to guard
            hook = functools.partial(_on_optimizer_step, weakref.ref(self))
            for optimizer in params.optimizers:
                handle = optimizer.register_step_pre_hook(hook)
                self._handles.append(handle)
                weakref.finalize(self, handle.remove).atexit = False

    # ------------------------------------------------------------------ what OWNERSHIP asks of a step
    def known_params(self) -> list[torch.Tensor]:
        """The step's parameters as last read (another step asks; nothing is checked)."""
        return self.params.known()

    def name(self) -> str:
        """The step's function as messages name it: ``train_step (defined at train.py:12)``."""
        return step_name(getattr(self.owner, "fn", None))

    def retire(self) -> None:
        """The user's handle on the step is gone: leave OWNERSHIP and stop watching the optimizers now,
        whenever the step's objects are collected (a reference cycle, a kept traceback)."""
        if self.retired:
            return
        self.retired = True
        for handle in self._handles:
            handle.remove()
        OWNERSHIP.retire(self, self.owner.pending)

    def __del__(self) -> None:
        # Collected with its step in a reference cycle (a step made per instance, whose function holds the
        # instance that holds the step): the handle's finalizer found the step's state gone, so the guard,
        # still whole here (PEP 442), retires the step itself, its open window remembered.
        with contextlib.suppress(Exception):  # (at interpreter exit the modules may be gone)
            self.retire()

    def owned_ids(self) -> set[int]:
        """The ids of the step's parameters."""
        return self.params.ids()

    def set_alone(self, alone: bool) -> None:
        """OWNERSHIP says whether this is the process's only live step. Alone, its windows are not
        registered (no other step sets them aside); with company, an open one is registered now (see
        ``Accumulator.company``)."""
        if alone == self.alone:
            return
        self.alone = alone
        if alone:
            OWNERSHIP.closed(self)
        elif self.owner.pending or self.sync.zeroed:
            OWNERSHIP.opened(self)
        self.owner.company(alone)

    # --------------------------------------------------------------------------------- each call
    def call_starts(self) -> None:
        """A call of the step starts (the short path stores :attr:`token` in ``OWNERSHIP.last`` itself)."""
        OWNERSHIP.last = self.token
        self.ran = True

    def refuse_shared_optimizer(self) -> None:
        """Before a call, when other steps' windows are open: refuse if one of them steps an optimizer this
        step steps too (nothing of the call has run).

        Raises:
            SpeedupsError: another step with an open window shares an optimizer with this one.
        """
        if not OWNERSHIP.sharing_optimizers(self):
            return
        # A step no one can reach any more (a class redefined in a notebook, an instance made anew) goes
        # first: collected here, nothing of it held meanwhile (its function may hold the step's owner).
        gc.collect()
        message = self._shared_optimizer_message()
        if message is not None:  # (raised from here: the traceback a notebook keeps holds no other step)
            raise SpeedupsError(message)

    def _shared_optimizer_message(self) -> str | None:
        """What :meth:`refuse_shared_optimizer` says of the first other step over one of this step's
        optimizers with an open window; None when there is none."""
        others = OWNERSHIP.sharing_optimizers(self)
        if not others:
            return None
        other = others[0]
        mine = {id(opt) for opt in self.params.optimizers}
        shared = next(opt for opt in other.params.optimizers if id(opt) in mine)
        name, this = other.name(), self.name()
        if name == this:  # the same function, made twice (a cell run again, a factory called twice)
            name = "an earlier step made from the same definition"
        return (
            f"accumulate: {this} and {name} are two @accumulate steps over one optimizer "
            f"({type(shared).__name__}), both alive, and the other's window is open "
            f"({other.owner.pending} of {other.owner.every} micro-steps): this call's backward would add to "
            f"that window, and each step "
            f"would step the optimizer at its own boundary on the other's half-accumulated gradients. Fix: "
            f"close the other's window first, `other_step.flush()` to apply it or `other_step.discard()` to "
            f"drop it (a step no longer referenced anywhere is dropped by itself: `del other_step`; in a "
            f"notebook, an earlier step shown as a cell's output stays referenced by the output history: "
            f"`Out[n].discard()`, or `%reset -f out`); or one step returning the sum of the losses "
            f"(`return main_loss + aux_loss`), or an optimizer per step (`accumulate(N, "
            f"torch.optim.Adam(aux_head.parameters()))`); steps over one optimizer may take turns only "
            f"window by window."
        )

    def window_opens(self) -> None:
        """The step's window opened: other steps set its gradients aside while they run."""
        if not self.alone:
            OWNERSHIP.opened(self)

    def between_calls(self) -> None:
        """Mid-window, before the step's function runs: did anything change the window since its last call?"""
        sentinel = self.sentinel
        if sentinel is None:
            return
        grad = sentinel.grad
        if grad is None:  # zero_grad() by hand
            self._warn_zero_grad()
            self.note()
        elif self.watch and (grad is not self.noted_grad or grad_version(grad) != self.noted_version):
            self._warn_changed(inside=False)  # a backward() outside the step, or a
            # zero_grad(set_to_none=False)

    def inside_call(self) -> None:
        """After the step's function, before its backward: did a ``backward()`` inside it add to the
        window?"""
        if self.watch and self.sentinel is not None:
            grad = self.sentinel.grad
            if grad is not self.noted_grad or (grad is not None and grad_version(grad) != self.noted_version):
                self._warn_changed(inside=True)

    def noted_after(self) -> None:
        """After the step's own backward (the short path, one process): :meth:`note`, warning first if the
        sentinel's gradient grew by more than that backward's one accumulation, which a ``backward()``
        inside the step's function adds (one read of the gradient per call instead of two)."""
        sentinel = self.sentinel
        if sentinel is None:
            self.note()
            return
        grad = sentinel.grad
        if grad is None:
            self.noted_grad, self.noted_version = None, -1
            return
        version = grad_version(grad)
        if grad is self.noted_grad and version > self.noted_version + 1 and self.watch:
            self._warn_changed(inside=True)  # notes itself
            return
        self.noted_grad, self.noted_version = grad, version

    def note(self) -> None:
        """Remember the sentinel's gradient as it is now (its tensor and version counter), choosing the
        sentinel first when the window has none yet (its first call)."""
        sentinel = self.sentinel
        if sentinel is None:
            sentinel = self.sentinel = self._with_grad()
        grad = None if sentinel is None else sentinel.grad
        self.noted_grad, self.noted_version = grad, -1 if grad is None else grad_version(grad)

    def _with_grad(self) -> torch.Tensor | None:
        """A parameter that has a gradient now, or None (the parameters as this window's start read them)."""
        for p in self.params.known():
            if p.grad is not None:
                return p
        return None

    # ------------------------------------------------------------------------- once per window
    def start_window(self) -> None:
        """At a window's start: drop the gradients this step did not make, as ``optimizer.zero_grad()`` at
        the top of a hand-written loop drops them.

        When another step ran since this one's last call, its backward made them (a GAN's generator loss
        through D: see :mod:`~speedups.accumulation.ownership`), silently dropped; otherwise a
        ``backward()`` outside any step or a ``zero_grad(set_to_none=False)`` (zeros) did, warned once.
        """
        zeroed = self.sync.zeroed  # DDP's zero gradients after a flush are this step's own
        strays = [p for p in self.params.all() if p.grad is not None and id(p) not in zeroed]
        self.clean_start = True
        if not strays:
            return
        shared = OWNERSHIP.in_open_windows(self)  # (rare) parameters shared with a step whose window is
        if shared:  # open hold that window's gradients: kept
            self.clean_start = not any(id(p) in shared for p in strays)
            strays = [p for p in strays if id(p) not in shared]
        for p in strays:
            p.grad = None
        left = OWNERSHIP.abandoned_on(strays) if strays and OWNERSHIP.abandoned else None
        if left is not None:  # a step whose handle went (a notebook cell run again) left its window open
            name, pending, every = left
            self._warn_once(
                "abandoned",
                f"accumulate: the window starting at micro-step {self.owner.step + 1} found the gradients "
                f"of a window {name} left open ({pending} of {every} micro-steps) when that step was "
                f"replaced or deleted; they were dropped, and that window took no optimizer step. To apply "
                f"an interrupted window, call the step's flush() before redefining it; to drop it without a "
                f"word, its discard().",
            )
            return
        another_ran = OWNERSHIP.last != (self.token if self.ran else self.born_after)
        if not strays or another_ran:  # another step ran since: its backward made them
            return
        self._warn_once(
            "strays",
            f"accumulate: the window starting at micro-step {self.owner.step + 1} found gradients on "
            f"{len(strays)} of the step's parameters that no step made: a `loss.backward()` outside the "
            f"step, or `zero_grad(set_to_none=False)`, left them. They were dropped, as "
            f"`optimizer.zero_grad()` at the top of a hand-written loop drops them. Fix: return every "
            f"loss from the step (`return main + aux`), and remove backward() and zero_grad() calls from "
            f"the loop.",
        )

    def first_call(self) -> None:
        """On a window's first call, after the step's function and before its backward: warn if a
        ``backward()`` already ran inside it (see :meth:`_backward_ran_inside`)."""
        if self._backward_ran_inside():
            self._warn_changed(inside=True)

    def _backward_ran_inside(self) -> bool:
        """Whether a ``backward()`` ran inside the window's first call (and is not yet warned about).

        The window started without gradients (:meth:`start_window`), so any gradient now was made inside
        the step's function: weighted 1 instead of the window's share, and without the fp16 loss scale. It
        looks at the previous window's sentinel (one parameter, reached by every backward through the
        model the step trains); the first window, at every parameter.
        """
        if "inner backward" in self.warned or not self.clean_start:
            return False
        if self.owner.every == 1 and self.updater.scaler is None and self.window.mode is not ITEMS:
            return False  # weighted 1 and unscaled is what the step's own backward does here: exact
        zeroed = self.sync.zeroed
        probe = self.last_sentinel
        if probe is not None:
            return probe.grad is not None and id(probe) not in zeroed
        return any(p.grad is not None and id(p) not in zeroed for p in self.params.all())

    def close_window(self) -> None:
        """The window was applied or dropped: hold no gradient the update let go; watch afresh."""
        if not self.alone:
            OWNERSHIP.closed(self)
        self.noted_grad, self.noted_version = None, -1
        if self.sentinel is not None:
            self.last_sentinel = self.sentinel
        self.sentinel = None

    def restored(self, pending: int) -> None:
        """A checkpoint put a window of ``pending`` calls back: watch it afresh."""
        self.sentinel = None
        self.noted_grad, self.noted_version = None, -1
        if not self.alone:
            (OWNERSHIP.opened if pending else OWNERSHIP.closed)(self)

    def params_changed(self, previous: set[int], params: list[torch.Tensor]) -> None:
        """The optimizers' parameters changed: what other steps set aside is stale; warn once if parameters
        joined mid-window with gradients earlier calls left."""
        OWNERSHIP.changed()
        owner = self.owner
        if not owner.pending:
            return
        joined = [p for p in params if id(p) not in previous and p.grad is not None]
        if not joined:
            return
        self._warn_once(
            "joined",
            f"accumulate: {len(joined)} parameters joined the step's optimizers in the middle of a window "
            f"(after micro-step {owner.step}, {owner.pending} of {owner.every} accumulated) with gradients "
            f"already on them: what every backward since they were last zeroed left, possibly more than "
            f"this window, counts in this update. Fix: add parameters at a boundary (`if "
            f"train_step.pending == 0:`), or keep them at requires_grad=False until they join.",
        )

    # ------------------------------------------------------------------------------------- warnings
    def _warn_changed(self, *, inside: bool) -> None:
        """Warn once: the open window's gradients changed outside the step's own backward."""
        self.note()
        owner = self.owner
        single = self.sync.kind is SyncKind.SINGLE
        ddp = live_wrapper_of(self.params.ids(), (DistributedDataParallel,)) if single else None
        if ddp is not None:  # DDP's own all-reduce rewrote the gradients: no backward of the user's
            self._warn_once(
                "ddp not given",
                f"accumulate: the step's parameters belong to a {type(ddp).__name__} that was not given as "
                f"model=, so DDP all-reduces and rewrites the gradients at every call's backward (what the "
                f"step saw as a backward it did not run), one all-reduce per micro-step instead of per "
                f"optimizer step. Fix: @accumulate({owner.every}, optimizer, model=ddp_model): the window's "
                f"calls then run in no_sync().",
            )
            return
        if inside:
            what = (
                f"a backward() ran inside the step (micro-step {owner.step + 1}) and added to the open "
                f"window's gradients, weighted 1 instead of 1/{owner.every}"
                f"{' and without the fp16 loss scale' if self.updater.scaler is not None else ''}"
            )
            fix = (
                "remove the backward() and return the loss (@accumulate runs the backward); with several "
                "losses, return their sum: `aux.backward(); return main` becomes `return main + aux`"
            )
        else:
            what = (
                f"the open window's gradients changed between the previous call of the step and this one "
                f"(micro-step {owner.step + 1}): a backward() outside the step added to them (weighted 1, "
                f"not 1/{owner.every}), or `zero_grad(set_to_none=False)` zeroed them"
            )
            fix = "return every loss from the step, and remove backward() and zero_grad() calls from the loop"
        self._warn_once(
            "inner backward" if inside else "changed",
            f"accumulate: {what}, so the update is not the big batch's. Fix: {fix}.",
        )

    def _warn_zero_grad(self) -> None:
        """Warn once: the open window's gradients were set to None by someone else (a zero_grad by hand)."""
        owner = self.owner
        self._warn_once(
            "zero_grad",
            f"accumulate: the gradients of the open accumulation window ({owner.pending} of {owner.every} "
            f"micro-steps) were set to None between the previous call of the step and this one (micro-step "
            f"{owner.step + 1}): `optimizer.zero_grad()` or `model.zero_grad()` is still in the loop, so "
            f"the window lost what it had accumulated. Fix: remove the zero_grad() call; @accumulate zeroes "
            f"the gradients after each optimizer step.",
        )

    def hand_step(self) -> None:
        """Warn once that the optimizer was stepped by hand while a window is open (not by this step)."""
        owner = self.owner
        if self.updater.updating or not owner.pending:
            return
        self._warn_once(
            "hand step",
            f"accumulate: optimizer.step() was called by hand on an optimizer that @accumulate steps "
            f"(after micro-step {owner.step}, {owner.pending} of {owner.every} of the window accumulated), "
            f"so it steps on micro-steps that should only accumulate. Fix: remove the `optimizer.step()` "
            f"(and `optimizer.zero_grad()`) from the loop; @accumulate steps once every {owner.every} "
            f"calls and `train_step.flush()` applies a short last window.",
        )

    def _warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` (a ``SpeedupsWarning``) at the user's line, the first time this step warns
        about ``key``."""
        if key in self.warned:
            return
        self.warned.add(key)
        warnings.warn(message, SpeedupsWarning, stacklevel=user_stacklevel())


def step_name(fn: Any) -> str:
    """``fn``'s name and where it was defined, ``train_step (defined at train.py:12)``: two steps made from
    functions of one name (a notebook cell run again) are told apart by line or cell file."""
    if fn is None:
        return "a step"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        code = inspect.unwrap(fn).__code__
    except (AttributeError, ValueError):  # a callable object, or a __wrapped__ loop
        return str(name)
    return f"{name} (defined at {code.co_filename}:{code.co_firstlineno})"


def _on_optimizer_step(owner: weakref.ref[Guard], optimizer: Any, args: Any, kwargs: Any) -> None:
    """The optimizer's step pre-hook: it holds the guard weakly and goes when the step is collected.

    """
    guard = owner()
    if guard is not None:
        guard.hand_step()

"""What ``tune_loader(step=...)`` lets its step do: forward and backward, not an update.

A step timed on every batch of the tuning runs thousands of times: with an update inside it would train the
model before training starts. :func:`refuse_accumulate_step` refuses an ``@accumulate`` step (or a function
calling one) before anything runs; :func:`updates_refused` wraps the step in a :class:`NoUpdates`, which
refuses an optimizer step inside it before that step changes anything, and puts back, then refuses, what
else an update moves (:class:`~speedups.data.step_guard.training_state.TrainingState`).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from speedups._helpers.validate import short
from speedups.data.step_guard.training_state import TrainingState
from speedups.errors import SpeedupsError

__all__ = ["NoUpdates", "refuse_accumulate_step", "step_name", "updates_refused"]

# What the message of a refused step says to do instead: the step's work, without its update, on a copy.
_PROBE_FIX = (
    "Time the model's work on a copy, without the update: probe = copy.deepcopy(model); "
    "tune_loader(loader, step=lambda batch: loss_fn(probe(batch[0]), batch[1]).backward())"
)
_ALLOWED = (
    "The step given to tune_loader may run forward and backward, not an update: no optimizer.step(), "
    "scheduler.step() or scaler.update()"
)


def _accumulate_step_of(obj: object) -> object | None:
    """The ``@accumulate`` step ``obj`` is, or wraps (``__wrapped__``: ``mixed_precision``,
    ``functools.wraps``; ``functools.partial``), or None. Known by its public API (the data layer does not
    import the accumulation layer): a class with the ``num_updates`` property, ``discard()`` and
    ``on_update()``."""
    for _ in range(16):
        kind = type(obj)
        if (
            isinstance(getattr(kind, "num_updates", None), property)
            and callable(getattr(kind, "discard", None))
            and callable(getattr(kind, "on_update", None))
        ):
            return obj
        inner = obj.func if isinstance(obj, functools.partial) else getattr(obj, "__wrapped__", None)
        if inner is None or inner is obj:
            return None
        obj = inner
    return None


def _names_used(code: types.CodeType) -> Iterator[str]:
    """The global and attribute names ``code`` and the functions defined in it refer to."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_used(const)


def _accumulate_step_in(step: object) -> str | None:
    """How ``step`` reaches an ``@accumulate`` step before it runs: it is one (or wraps one), or it is a
    function that calls one by a global name or from its closure (``lambda batch: train_step(*batch)``).
    Returns the words for the message, or None."""
    found = _accumulate_step_of(step)
    if found is not None:
        return (
            f"{step_name(step)} is an @accumulate step"
            if found is step
            else f"it wraps {step_name(found)}, an @accumulate step"
        )
    fn = step.func if isinstance(step, functools.partial) else step
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    if not isinstance(fn, types.FunctionType):
        return None
    used = [(name, fn.__globals__.get(name)) for name in dict.fromkeys(_names_used(fn.__code__))]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            used.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    for name, obj in used:
        if obj is not None and _accumulate_step_of(obj) is not None:
            return f"it calls {name}, an @accumulate step"
    return None


def step_name(fn: object) -> str:
    """How a message names a step: its ``__name__``, a partial by its function."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({step_name(fn.func)}, ...)"
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else short(fn)


def refuse_accumulate_step(step: object, said: str) -> None:
    """Refuse, before anything runs, a step that is or calls an ``@accumulate`` step.

    Raises:
        SpeedupsError: it is one; nothing has run.
    """
    how = _accumulate_step_in(step)
    if how is not None:
        raise SpeedupsError(
            f"{said}: {how}: run on every timed batch (thousands), it would train the model and move its "
            f"counters, window and scheduler before training starts; nothing was run. {_ALLOWED}. "
            f"{_PROBE_FIX}."
        )


class NoUpdates:
    """The step as ``tune_loader`` calls it: an optimizer step inside it is refused before it changes a thing,
    and the rest of the training state it moves is put back and refused.

    While tuning, one global optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``, removed
    after) raises :class:`~speedups.SpeedupsError` when a ``torch.optim.Optimizer`` steps inside a
    call of the step in this thread: the weights and the optimizer's state are as they were. A step that
    catches the error and goes on is refused when it returns. What an update moves besides (a scheduler, the
    optimizers' hyperparameters, a GradScaler: :class:`TrainingState`) is compared after calls 1, 2, 4, 8,
    ... and when tuning ends (:meth:`check`); a change is put back, then refused.
    """

    def __init__(self, step: Callable[[Any], object], said: str, state: TrainingState) -> None:
        self.step, self.said, self.state = step, said, state
        self.calls = 0
        self.thread: int | None = None  # the thread inside a call of the step, None between calls
        self.refused = ""

    def __call__(self, batch: Any) -> object:
        self.calls += 1
        self.thread = threading.get_ident()
        try:
            out = self.step(batch)
        finally:
            self.thread = None
        if self.refused:  # the step caught the refusal and went on: the optimizer still did not step
            raise SpeedupsError(self.refused)
        if self.calls & (self.calls - 1) == 0:  # calls 1, 2, 4, 8, ...: log2(calls) comparisons in all
            self.check()
        return out

    def check(self) -> None:
        """Refuse a step that moved a scheduler, a hyperparameter or a GradScaler, once they are put back.

        Raises:
            SpeedupsError: something moved since tuning began; it is as it was before tuning now.
        """
        changes = self.state.changes()
        if not changes:
            return
        self.state.put_back()
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise SpeedupsError(
            f"{self.said}: the step moved the training state by timed batch {self.calls}: {shown}. Run on "
            f"every timed batch (thousands), it would move it before training starts (a "
            f"StepLR(step_size=100, gamma=0.5) stepped at each timed batch left lr at 4.5e-14 after 1 s); it "
            f"is put back exactly as it was before tuning. {_ALLOWED}. {_PROBE_FIX}."
        )

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.thread is None or self.thread != threading.get_ident():
            return  # not inside the step (another thread's optimizer, or after tuning)
        self.refused = (
            f"{self.said}: the step called {type(optimizer).__name__}.step() on timed batch {self.calls}: "
            f"run on every timed batch (thousands), it would train the model before training starts; refused "
            f"before that optimizer changed anything (the weights and its state are as they were, the "
            f"gradients the step's backward left are still there). {_ALLOWED}. {_PROBE_FIX}."
        )
        raise SpeedupsError(self.refused)


@contextmanager
def updates_refused(
    step: Callable[[Any], object] | None, said: str
) -> Iterator[Callable[[Any], object] | None]:
    """``step`` wrapped in :class:`NoUpdates`, with its optimizer step pre-hook registered for the block and
    the training state (:class:`TrainingState`) recorded when it starts, checked when it ends and put back
    whatever ends it.

    Raises:
        SpeedupsError: the block ended well and the state moved (put back first).
    """
    if step is None:
        yield None
        return
    state = TrainingState.capture()
    guarded = NoUpdates(step, said, state)
    handle = register_optimizer_step_pre_hook(guarded.before_optimizer_step)
    try:
        yield guarded
        guarded.check()  # a step that moved something after the last power-of-two call
    finally:
        handle.remove()
        state.put_back()  # a no-op where nothing moved; an error in flight keeps its own message

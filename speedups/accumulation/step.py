"""The decorated step the user holds: ``@accumulate``'s visible state and methods, on functions and methods.

A wrapt ``FunctionWrapper`` (bound methods get a ``BoundFunctionWrapper``) whose attributes read the
accumulator (:mod:`speedups.accumulation.accumulator`, typed here by the :class:`StepOwner` protocol);
nothing here runs on the hot path.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import torch
import wrapt
from torch.utils.hooks import RemovableHandle

from speedups._helpers import compat
from speedups.accumulation.update_record import UpdateRecord

__all__ = ["Step", "StepOwner"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class StepOwner(Protocol):
    """What a :class:`Step` shows and forwards: the accumulator behind it."""

    every: int
    step: int
    is_boundary: bool
    pending: int
    micro: Any
    updater: Any  # the Update: num_updates, scaler, last_step_skipped, probe, last_grad_norm, hooks

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...
    def wraps(self, fn: Callable[..., Any], body: Callable[..., Any]) -> None: ...
    def flush(self) -> None: ...
    def discard(self) -> int: ...
    def retire(self) -> None: ...
    def epoch(self, batches: Iterable[T]) -> Iterator[T]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def check_state(self, state: Any) -> None: ...
    def merge_states(self, states: list[Any], change: Any) -> dict[str, Any]: ...


def _shown(name: str, doc: str) -> Any:
    """A read-only property showing the accumulator's attribute ``name``."""
    return property(lambda self: getattr(self._acc(), name), doc=doc)


def _updates(name: str, doc: str) -> Any:
    """A read-only property showing the attribute ``name`` of the accumulator's update."""
    return property(lambda self: getattr(self._acc().updater, name), doc=doc)


class _StepAttributes:
    """The visible state of a decorated step, shared by the function and its bound methods."""

    def _acc(self) -> StepOwner:
        raise NotImplementedError

    every = _shown("every", "Micro-steps (calls) per optimizer step: the N of ``accumulate(N, ...)``.")
    step = _shown("step", "Micro-steps (calls) so far.")
    is_boundary = _shown("is_boundary", "Whether the current call (or the last one, after it) ends a window.")
    num_updates = _updates("num_updates", "Optimizer steps really taken (skipped ones not counted).")
    pending = _shown("pending", "Calls accumulated in the open window, not yet applied.")
    micro_batch_size = property(
        lambda self: getattr(self._acc().micro, "size", None),
        doc='Rows per micro-batch: the fixed size; under ``"auto"`` the size '
        "found on out of memory, None while whole batches fit; None without ``micro_batch_size=``.",
    )
    memory_plan = property(
        lambda self: getattr(getattr(self._acc().micro, "plan", None), "choice", None),
        doc="With ``memory_budget=``: the plan chosen (a ``PlanChoice``: ``micro_batch_size``, the blocks "
        "the plan ``checkpointed`` (yours stay as you set them), measured ``bytes``, ``seconds_per_row``), "
        "None while it measures (a probe call, then three calls per candidate) or without a budget.",
    )
    scaler = _updates("scaler", 'The GradScaler adopted from ``mixed_precision("fp16")``, or None.')
    last_step_skipped = _updates("last_step_skipped", "Whether the last optimizer step was skipped (a bool).")

    last_grad_norm = _updates(
        "last_grad_norm",
        "The total 2-norm of the last update's gradient before clipping: a 0-dim device tensor (no sync), "
        "summed in ``model.parameters()`` order with ``model=``; None until the step computed one (it does "
        "with ``max_grad_norm``, an fp16 GradScaler or ``skip_nonfinite``).",
    )

    def on_update(self, fn: Callable[[UpdateRecord], Any]) -> RemovableHandle:
        """Call ``fn(record)`` after every optimizer step really taken; return a handle with ``.remove()``.

        Flushed windows count, skipped ones (fp16 overflow, NaN with ``skip_nonfinite``, zero items) do not.
        ``record`` is an :class:`~speedups.UpdateRecord`: micro-steps, updates, the window's mean loss and
        item count as device tensors, the gradient norm, the learning rates; reading none of it syncs. The
        place for an EMA of the weights (``torch.optim.swa_utils.AveragedModel.update_parameters``),
        per-update logging and counters. Hooks run in registration order, after the scheduler stepped and
        the gradients were zeroed; an exception in one propagates from the call that made the update.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        return self._acc().updater.on_update(fn)

    def before_update(self, fn: Callable[[list[torch.Tensor]], Any]) -> RemovableHandle:
        """Call ``fn(params)`` just before every optimizer step really taken; return a removable handle.

        ``params`` lists the optimizers' parameters that have a gradient (in ``model.parameters()`` order
        with ``model=``), and each ``p.grad`` is final: the window's exact mean, summed over the ranks,
        unscaled (fp16) and clipped (``max_grad_norm``/``max_grad_value``). Edit them in place to change the
        update: custom clipping, gradient noise, statistics. ``train_step.num_updates`` still counts the
        updates before this one. A skipped update (fp16 overflow, ``skip_nonfinite``, zero items) calls no
        hook. Adds no sync; what ``fn`` reads is its own. Hooks run in registration order.

        Raises:
            TypeError: ``fn`` is not a function of one argument.
        """
        return self._acc().updater.before_update(fn)

    @property
    def found_inf(self) -> torch.Tensor | None:
        """Whether the last update saw NaN/inf: a 0-dim bool device tensor (no sync); None before one."""
        probe = self._acc().updater.probe
        return None if probe is None else ~torch.isfinite(probe)

    def flush(self) -> None:
        """Apply the pending short window now, normalised by what it accumulated; no-op if none is pending.

        Under DDP every rank must call it: one small all-reduce (which parameters have a gradient on some
        rank, and the item count; a host sync), then one per gradient dtype. Unused everywhere: None.
        """
        self._acc().flush()

    def discard(self) -> int:
        """Drop the open window without an optimizer step; return the calls it held (0: none was open).

        The window's gradients are set to None and :attr:`pending` goes back to 0, as if its calls had not
        run (:attr:`step` still counts them). For a loop interrupted mid-window (Ctrl-C in a notebook)
        whose partial window should not count; :meth:`flush` applies it instead. No sync; under DDP every
        rank must call it, so that the ranks' windows stay aligned.

        Raises:
            SpeedupsError: an FSDP2 model's gradient sync was off for the window (FSDP2 holds those
                gradients in buffers no public API drops; nothing is changed).
        """
        return self._acc().discard()

    def __dir__(self) -> list[str]:
        # wrapt shows the wrapped function's names only: add the step's (tab completion, help())
        return sorted(set(super().__dir__()) | _STEP_NAMES)

    def epoch(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield from ``batches`` and :meth:`flush` when they are exhausted: windows never straddle epochs.

        After :func:`~speedups.load_checkpoint` restored a window saved inside ``epoch()``, the next
        ``epoch(loader)`` continues it: it is the same epoch, resumed mid-way (a
        :class:`~speedups.DistributedLoader` must resume mid-epoch too, as its checkpoint makes it).

        Raises:
            SpeedupsError: a window of an earlier epoch is still pending (a loop broke out without flush()).
        """
        return self._acc().epoch(batches)

    def state_dict(self) -> dict[str, Any]:
        """Return the step's state with a copy of the pending gradients (one gradient's memory) and scaler.

        Saved with the model and optimizer, it resumes mid-window with the same weights as not stopping.
        """
        return self._acc().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the pending gradients too).

        Loaded before the first fp16 call, the saved loss scale waits for the step's GradScaler and is
        applied when ``mixed_precision`` hands it over: saving the step alone resumes fp16 exactly.

        Raises:
            ValueError: not such a dict, or made with another window size or model (nothing changed).
        """
        self._acc().load_state_dict(state)

    def _check_state(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing."""
        self._acc().check_state(state)

    def _merge_rank_states(self, states: list[Any], change: Any) -> dict[str, Any]:
        """This rank's state from what every rank saved on another layout (``load_checkpoint`` calls it)."""
        return self._acc().merge_states(states, change)


_STEP_NAMES = frozenset(name for name in vars(_StepAttributes) if not name.startswith("_"))


class _BoundStep(_StepAttributes, wrapt.BoundFunctionWrapper):
    def _acc(self) -> StepOwner:
        return self._self_parent._self_acc


class Step(_StepAttributes, wrapt.FunctionWrapper, Generic[F]):
    __bound_function_wrapper__ = _BoundStep

    def __init__(self, wrapped: F, acc: StepOwner) -> None:
        box: list[weakref.ref[Step[F]]] = []
        body = _outside_graphs(wrapped, box)
        acc.wraps(wrapped, body)
        super().__init__(body, acc)
        box.append(weakref.ref(self))  # weakly: a step no one holds goes at once, not at the next gc
        self._self_acc = acc
        # The user's handle decides whether the step is alive: once it goes (its name rebound by a re-run
        # notebook cell, a function returned), the step retires at once, even where its accumulator lives on
        # in a reference cycle or a kept traceback, and blocks no later step.
        # (The accumulator is held weakly: a hook of the user's may hold the step, and a strong reference
        # from the finalizer registry would keep that cycle alive for ever.)
        weakref.finalize(self, _retire, weakref.ref(acc)).atexit = False

    def _acc(self) -> StepOwner:
        return self._self_acc


def _retire(acc: weakref.ref[StepOwner]) -> None:
    """The step's handle is gone: retire its accumulator, if it lives on (else it went with the handle)."""
    owner = acc()
    if owner is not None:
        owner.retire()


def _outside_graphs(fn: F, box: list[Any]) -> F:
    """``fn`` as the step wraps it, run outside any ``torch.compile`` graph.

    torch.compile (dynamo) sees through the step's wrapper to the function it wraps and would trace that
    alone, skipping the step (no backward, no update): traced, this calls the step itself through
    :func:`_step_runs_eagerly`, which dynamo never traces (a graph break; with ``fullgraph=True`` an error
    that says why and what to compile instead), where it runs eagerly as usual. Eager cost: none, the step
    calls ``fn`` itself unless wrapt hands it a bound method.
    """

    @functools.wraps(fn)
    def step_body(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by dynamo: the step, eagerly
            return _step_runs_eagerly(box[0](), args, kwargs)
        return fn(*args, **kwargs)

    return step_body  # type: ignore[return-value]


def _step_runs_eagerly(step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``step``; ``torch.compile`` breaks its graph here and runs this, and all below it, eagerly."""
    return step(*args, **kwargs)


compat.graph_break_at(
    _step_runs_eagerly,
    "an @accumulate step runs eagerly: its backward and optimizer update belong in no graph. With "
    "fullgraph=True, compile the model or the loss computation and call the step outside the compiled "
    "function: `model = torch.compile(model, fullgraph=True)`, then `train_step(x, y)` in the loop",
)

"""A step's checkpoint state: its checks, and its merge when a run resumes on another number of processes.

``train_step.state_dict()`` holds the counters, the open window (its gradients copied, its counts, its
log), the GradScaler's state and the memory plan's. Everything is checked before anything is restored, so
a wrong file leaves the step as it was. A state saved by several ranks is merged for a new layout
(:mod:`speedups.checkpoint.layout_change`): the open window's gradients become what the new ranks would
hold after its calls, in the units the step accumulates in.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from speedups._helpers.layout import LayoutChange
from speedups.accumulation.epoch_pass import EpochPass
from speedups.accumulation.grad_sync import GradSync
from speedups.accumulation.guard import Guard
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.replay import PendingCalls
from speedups.accumulation.update import Update
from speedups.accumulation.window import ITEMS, Mode, Window

__all__ = ["check_state", "check_step_state", "load_step_state", "merge_states", "merged_log", "step_state"]

MODES = tuple(mode.value for mode in Mode)


class _Step(Protocol):
    """What the state reads of a step (its accumulator) and the one way it sets the step's counters."""

    every: int
    step: int
    pending: int
    sync: GradSync
    micro: Any
    window: Window
    params: StepParameters
    updater: Update
    guard: Guard
    passes: EpochPass
    replay: PendingCalls | None

    def resume_at(self, step: int, pending: int) -> None: ...


def step_state(acc: _Step) -> dict[str, Any]:
    """The step's state, with a copy of the open window's gradients (one gradient's memory) and scaler.

    Under FSDP2 the open window's gradients sit unreduced in FSDP2's own buffers, which no public API reads:
    the state holds the pending calls instead (their inputs, RNG states and the window's buffers: see
    :mod:`.replay`), which the step makes again before its first call after loading.

    Raises:
        SpeedupsError: an FSDP2 window's pending call was given an input a checkpoint cannot hold.
    """
    pending = acc.pending
    replay = None
    if pending and acc.replay is not None:
        replay = acc.replay.state(pending, "accumulate(...).state_dict()")
    grads = None
    if pending and replay is None:
        grads = [None if p.grad is None else p.grad.detach().clone() for p in acc.params.all()]
    return {
        "every": acc.every,
        "step": acc.step,
        "num_updates": acc.updater.num_updates,
        "pending": pending,
        **acc.window.state_dict(),
        "grads": grads,
        "replay": replay,
        "scaler": acc.updater.scaler_state(),
        **acc.passes.state_dict(pending),
        "plan": None if acc.micro is None else acc.micro.plan_state(),
    }


def load_step_state(acc: _Step, state: dict[str, Any]) -> None:
    """Restore what :func:`step_state` returned into ``acc`` (checked before: :func:`check_step_state`)."""
    acc.updater.restore(state["num_updates"], state.get("scaler"))
    grads = state["grads"]
    if grads is not None:
        for p, g in zip(acc.params.all(), grads, strict=True):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    pending = state["pending"]
    acc.resume_at(state["step"], pending)
    acc.window.load_state_dict(state)
    acc.passes.load_state_dict(state, pending)
    if acc.micro is not None:
        acc.micro.take_plan(state.get("plan"))
    acc.guard.restored(pending)
    acc.sync.restart(pending)
    if acc.replay is not None:
        replay = state.get("replay")
        acc.replay.load(replay) if replay is not None and pending else acc.replay.clear()


def check_state(state: Any, every: int, params: Sequence[torch.Tensor], modes: tuple[str, ...]) -> None:
    """Check a ``train_step.state_dict()`` for a step over ``every`` micro-steps of these ``params``.

    ``modes`` are the weighing modes a state may name (besides None).

    Raises:
        ValueError: ``state`` is not such a dict, or was made with another window size or model.
    """
    call = "accumulate(...).load_state_dict(state)"
    keys = {"every", "step", "num_updates", "pending", "mode", "total_host", "total_device", "grads"}
    if not isinstance(state, dict) or not keys <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{call}: expected the dict of train_step.state_dict(), "
            f"with keys {sorted(keys | {'scaler', 'losses'})}, got {got}."
        )
    if state["every"] != every:
        raise ValueError(
            f"{call}: the checkpoint accumulated over "
            f"{state['every']!r} micro-steps, this step over {every}. Decorate with "
            f"accumulate({state['every']}, ...) to resume it."
        )
    for key in ("step", "num_updates", "pending"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{call}: state[{key!r}]={value!r}, expected an int >= 0.")
    if state["pending"] >= every:
        raise ValueError(f"{call}: state['pending']={state['pending']!r}, expected < every={every}.")
    if state["mode"] is not None and state["mode"] not in modes:
        raise ValueError(
            f"{call}: state['mode']={state['mode']!r}, expected None, {' or '.join(map(repr, modes))}."
        )
    if isinstance(state["total_host"], bool) or not isinstance(state["total_host"], (int, float)):
        raise ValueError(f"{call}: state['total_host']={state['total_host']!r}, expected a number.")
    if state["total_device"] is not None and not isinstance(state["total_device"], torch.Tensor):
        raise ValueError(f"{call}: state['total_device'] must be None or a tensor.")
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


def check_step_state(
    state: Any, every: int, params: Sequence[torch.Tensor], micro: Any, replay: PendingCalls | None = None
) -> None:
    """Raise what loading ``state`` into a step would raise (``ValueError``), changing nothing.

    ``micro``: the step's micro-batcher (its memory plan's state is checked too), or None. ``replay``: an
    FSDP2 step's pending calls (a window saved mid-way must be one saved under FSDP2), or None.
    """
    check_state(state, every, params, MODES)
    call = "accumulate(...).load_state_dict(state)"
    saved = state.get("replay")
    if state["pending"] and (saved is not None) != (replay is not None):
        how = "under FSDP2, as the calls that made it" if saved is not None else "as gradients, without FSDP2"
        raise ValueError(
            f"{call}: the checkpoint's window ({state['pending']} micro-steps pending) was saved {how}"
            f"; this step's model {'is not' if replay is None else 'is'} FSDP2, so they cannot be put back. "
            f"Resume with the model wrapped as it was saved, or from a checkpoint taken at a boundary "
            f"(train_step.pending == 0)."
        )
    if state["pending"] and replay is not None:
        replay.check(saved, state["pending"], call)
    if micro is not None:
        micro.check_plan(state.get("plan"))
    scaler = state.get("scaler")
    is_scaler_state = isinstance(scaler, dict) and {"scale", "_growth_tracker"} <= set(scaler)
    if scaler is not None and not is_scaler_state:
        raise ValueError(
            "accumulate(...).load_state_dict(state): state['scaler'] is not a GradScaler state (a dict "
            "with 'scale' and '_growth_tracker'). Pass what train_step.state_dict() returned."
        )


def merge_states(
    states: list[Any], change: LayoutChange, every: int, params: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """This rank's state from what every rank saved on another layout (see ``layout_change``).

    The open window's gradients are what the new layout's ranks would hold after ``change.pending``
    micro-steps of it: summed over the saved ranks and shared alike by the new ones, in the units the step
    accumulates in (mean losses: ``1/every`` each, averaged over the ranks by the sync; item counts: the
    items' summed gradient, with a weight reference of 1). The item count goes to rank 0.

    Raises:
        ValueError: a saved state is not a step's state, or was made for another model.
    """
    for state in states:
        saved_every = state.get("every") if isinstance(state, dict) else None
        check_state(state, saved_every if isinstance(saved_every, int) else every, params, MODES)
    first, rank, world = states[0], change.rank, change.world
    pending = first["pending"] if change.pending is None else change.pending
    if pending and any(s.get("replay") is not None for s in states):
        raise ValueError(
            f"accumulate(...).load_state_dict(state): the checkpoint's window ({first['pending']} "
            f"micro-steps pending on each of {change.saved_world} ranks) was saved under FSDP2 as each "
            f"rank's calls, which only the same ranks can make again; resumed on {world} "
            f"process{'es' if world > 1 else ''}. "
            f"Resume it on {change.saved_world} ranks, or from a checkpoint taken at a boundary "
            f"(train_step.pending == 0), which any number of processes resumes."
        )
    items = first["mode"] == ITEMS.value
    ref = first.get("ref_n", 1.0) if world == 1 and change.saved_world == 1 else 1.0
    grads = None
    if pending:
        if items:  # every sample's gradient summed: sum(ref_r * g_r), then shared by the new ranks
            weights = [float(s.get("ref_n", 1.0)) / (world * float(ref)) for s in states]
        else:  # mean losses: the ranks' mean, which each new rank holds (the sync averages it)
            weights = [1.0 / change.saved_world] * len(states)
        grads = [_weighted_sum([s["grads"][i] for s in states], weights) for i in range(len(first["grads"]))]
    host = sum(float(s["total_host"]) for s in states) if rank == 0 else 0.0
    devices = [s["total_device"] for s in states if s["total_device"] is not None]
    device = None
    if devices:
        device = functools.reduce(torch.add, devices) if rank == 0 else torch.zeros_like(devices[0])
    return {
        **first,
        "every": every,
        "step": first["step"] if change.micro_steps is None else change.micro_steps,
        "pending": pending,
        "total_host": host,
        "total_device": device,
        "grads": grads,
        "losses": [x for s in states for x in s.get("losses", [])] if rank == 0 else [],
        "ref_n": ref,
        "log": merged_log([s.get("log", []) for s in states], pending, items, rank) if pending else [],
        "feed": None,  # epoch(loader) says again which loader feeds it, in this layout
    }


def _weighted_sum(grads: list[Any], weights: list[float]) -> torch.Tensor | None:
    """``sum(w * g)`` over the ranks' gradients of one parameter, in rank order; None if no rank had one."""
    total = None
    for g, w in zip(grads, weights, strict=True):
        if g is not None:
            part = g * w if w != 1.0 else g.clone()
            total = part if total is None else total + part
    return total


def merged_log(logs: list[list[Any]], pending: int, items: bool, rank: int) -> list[tuple[Any, Any]]:
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

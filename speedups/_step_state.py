"""The checkpoint state of an ``@accumulate`` step: what it saves, checks and restores, and when ``epoch()``
may continue a restored window.

A step restored before its first fp16 call has no GradScaler yet (``mixed_precision`` hands it over on that
call): the saved scaler state is kept on the step and applied when the scaler arrives (``adopt_scaler``).
A restored window flushed before that call (a checkpoint taken after an epoch's last micro-step) is
unscaled by a stand-in GradScaler built from the saved state, whose state then passes to the real one.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from speedups._step_checks import check_state
from speedups.distributed_loader import DistributedLoader
from speedups.errors import SpeedupsError

__all__ = ["check", "check_continues", "handed_over", "load", "save", "stand_in_scaler"]


def _params(acc: Any) -> list[torch.nn.Parameter]:
    return [p for g in acc.optimizer.param_groups for p in g["params"]]


def save(acc: Any) -> dict[str, Any]:
    """The step's state, with a copy of the open window's gradients (one gradient's memory) and scaler."""
    grads = [None if p.grad is None else p.grad.detach().clone() for p in _params(acc)]
    return {
        "every": acc.every,
        "step": acc.step,
        "num_updates": acc.num_updates,
        "pending": acc.pending,
        "mode": None if acc.mode is None else acc.mode.value,
        "total_host": acc.total_host,
        "total_device": None if acc.total_device is None else acc.total_device.clone(),
        "grads": grads if acc.pending else None,
        "scaler": acc.restored_scaler if acc.scaler is None else acc.scaler.state_dict(),
        "losses": [loss.clone() for loss in acc.losses],
        "ref_n": acc.ref_n.clone() if isinstance(acc.ref_n, torch.Tensor) else acc.ref_n,
        "in_epoch": bool(acc.in_epoch and acc.pending),  # the open window belongs to a running epoch()
    }


def check(acc: Any, state: Any, modes: tuple[str, ...]) -> None:
    """Raise what :func:`load` would raise for ``state`` (ValueError), changing nothing."""
    check_state(state, acc.every, _params(acc), modes)
    scaler = state.get("scaler")
    if scaler is not None and not (isinstance(scaler, dict) and {"scale", "_growth_tracker"} <= set(scaler)):
        raise ValueError(
            "accumulate(...).load_state_dict(state): state['scaler'] is not a GradScaler state (a dict with "
            "'scale' and '_growth_tracker'). Pass what train_step.state_dict() returned."
        )


def load(acc: Any, state: dict[str, Any], mode_type: type[enum.Enum]) -> None:
    """Restore a checked ``state`` (see :func:`check`) into ``acc``."""
    if state.get("scaler") is not None:
        if acc.scaler is not None:
            acc.scaler.load_state_dict(state["scaler"])
        else:  # the scaler arrives with the first fp16 call, which applies this (adopt_scaler)
            acc.restored_scaler = dict(state["scaler"])
    grads = state["grads"]
    if grads is not None:
        for p, g in zip(_params(acc), grads, strict=True):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    acc.step = state["step"]
    acc.num_updates = state["num_updates"]
    acc.pending = state["pending"]
    acc.mode = None if state["mode"] is None else mode_type(state["mode"])
    acc.total_host = float(state["total_host"])
    acc.host_items = acc.total_host > 0  # items counted on the host: the window holds some, no sync needed
    acc.total_device = state["total_device"]
    acc.losses = list(state.get("losses", []))
    acc.ref_n = state.get("ref_n", 1.0)
    acc.resumed_in_epoch = bool(state.get("in_epoch", False)) and acc.pending > 0
    acc.sync.restart()


def check_continues(acc: Any, batches: Any) -> None:
    """Refuse to start ``epoch(batches)`` over a pending window unless it was restored from this epoch.

    A window saved inside ``epoch()`` belongs to that epoch; a :class:`DistributedLoader` restored with it
    resumes that epoch mid-way (at least ``pending`` batches in), which is what tells the two apart.
    """
    position = batches.state_dict() if isinstance(batches, DistributedLoader) else None
    if acc.resumed_in_epoch and (position is None or position["batches"] >= acc.pending):
        return
    where = ""
    if acc.resumed_in_epoch and position is not None:
        where = (
            f" The checkpoint was taken inside an epoch, but the loader starts epoch {position['epoch']} at "
            f"batch {position['batches']}: load it with the checkpoint too (loader=loader) so it resumes "
            f"where the window was saved."
        )
    raise SpeedupsError(
        f"accumulate(...).epoch(loader): {acc.pending} micro-steps of an earlier epoch are still pending. "
        f"Call train_step.flush() before starting a new epoch.{where}"
    )


def handed_over(acc: Any) -> dict[str, Any] | None:
    """The scaler state a newly arrived GradScaler must take: the stand-in's, or one loaded earlier."""
    if acc.stand_in:
        return dict(acc.scaler.state_dict())
    state, acc.restored_scaler = acc.restored_scaler, None
    return state


def stand_in_scaler(acc: Any) -> None:
    """Before a flush with a restored scaler state and no scaler yet: build one from that state."""
    if acc.scaler is not None or acc.restored_scaler is None:
        return
    device = next((p.device for p in _params(acc)), torch.device("cpu"))
    scaler = torch.amp.GradScaler(device.type)
    scaler.load_state_dict(acc.restored_scaler)
    scaler.scale(torch.zeros((), device=device))  # builds its scale tensor from the loaded state (lazy)
    acc.scaler, acc.stand_in, acc.restored_scaler = scaler, True, None

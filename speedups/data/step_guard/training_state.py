"""What an optimizer update moves besides the weights: schedulers, hyperparameters, GradScalers, recorded
so that ``tune_loader`` can tell whether a step it times moved them and put them back."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from speedups._helpers.validate import short

__all__ = ["TrainingState"]

_SCHEDULERS = (LRScheduler, ReduceLROnPlateau)  # ReduceLROnPlateau: an LRScheduler only since torch 2.2


class TrainingState:
    """What an update moves besides the weights and the optimizer state, as it was when tuning began.

    Every live LR scheduler's ``state_dict()`` (``torch.optim.lr_scheduler.LRScheduler``,
    ``ReduceLROnPlateau``), every live ``torch.optim.Optimizer``'s ``param_groups`` hyperparameters (lr,
    momentum, betas, weight_decay, ...; every key but ``params``, and the groups themselves) and every
    enabled ``torch.amp.GradScaler``'s ``state_dict()`` (its scale and growth tracker are read with
    ``.item()``: a sync with CUDA, at each comparison). Found by one scan of the live objects (``gc``: about
    35 ms per million objects) when tuning starts; one made later is not seen. Tensors are cloned, other
    values kept as they are (numbers, and lists and tuples of them).
    """

    def __init__(self) -> None:
        self.schedulers: list[tuple[Any, dict[str, Any]]] = []
        # (optimizer, its groups, each group's values but params as (the value, a copy of it))
        self.optimizers: list[tuple[torch.optim.Optimizer, list[dict[str, Any]], list[dict[str, Any]]]] = []
        self.scalers: list[tuple[torch.amp.GradScaler, dict[str, Any]]] = []

    @classmethod
    def capture(cls) -> TrainingState:
        """Record the live schedulers, optimizers and enabled GradScalers as they are now."""
        state = cls()
        for obj in gc.get_objects():
            kind = type(obj)  # type(), not isinstance: a proxy's __class__ is not asked
            if issubclass(kind, _SCHEDULERS):
                state.schedulers.append((obj, _cloned(obj.state_dict())))
            elif issubclass(kind, torch.optim.Optimizer):
                groups = list(obj.param_groups)
                values = [{k: (v, _cloned(v)) for k, v in g.items() if k != "params"} for g in groups]
                state.optimizers.append((obj, groups, values))
            elif issubclass(kind, torch.amp.GradScaler) and obj.is_enabled():
                state.scalers.append((obj, obj.state_dict()))
        return state

    def changes(self) -> list[str]:
        """What moved since :meth:`capture`, one entry per object, e.g. ``"StepLR: last_epoch 0 -> 1"``."""
        found = []
        for scheduler, saved in self.schedulers:
            moved = _moved(saved, scheduler.state_dict())
            if moved:
                found.append(f"{type(scheduler).__name__}: {moved}")
        for optimizer, groups, values in self.optimizers:
            name = type(optimizer).__name__
            if len(optimizer.param_groups) != len(groups) or any(
                a is not b for a, b in zip(optimizer.param_groups, groups, strict=False)
            ):
                found.append(f"{name}.param_groups: {len(groups)} group(s) -> {len(optimizer.param_groups)}")
            for i, (group, saved_group) in enumerate(zip(groups, values, strict=True)):
                saved = {k: copy for k, (_, copy) in saved_group.items()}
                moved = _moved(saved, {k: v for k, v in group.items() if k != "params"})
                if moved:
                    found.append(f"{name}.param_groups[{i}]: {moved}")
        for scaler, saved in self.scalers:
            moved = _moved(saved, scaler.state_dict())
            if moved:
                found.append(f"{type(scaler).__name__}: {moved}")
        return found

    def put_back(self) -> None:
        """Put back exactly what moved: each scheduler's ``load_state_dict``, each hyperparameter (the same
        object, a tensor's values copied back in place), each scaler's ``load_state_dict``, after clearing
        what ``scaler.scale()``/``unscale_()``/``step()`` left for the iteration (``update(new_scale=)``
        with the scale it had: a record left there would make the first real ``scaler.step()`` skip its
        unscaling and step on gradients 65,536 times too large)."""
        for scheduler, saved in self.schedulers:
            if _moved(saved, scheduler.state_dict()):
                scheduler.load_state_dict(_cloned(saved))
        with torch.no_grad():
            for optimizer, groups, values in self.optimizers:
                if len(optimizer.param_groups) != len(groups) or any(
                    a is not b for a, b in zip(optimizer.param_groups, groups, strict=False)
                ):
                    optimizer.param_groups[:] = groups
                for group, saved_group in zip(groups, values, strict=True):
                    for key in [k for k in group if k != "params" and k not in saved_group]:
                        del group[key]
                    for key, (value, copy) in saved_group.items():
                        if key not in group or group[key] is not value or not _same(copy, value):
                            _copy_into(value, copy)
                            group[key] = value
        for scaler, saved in self.scalers:
            with suppress(AssertionError):  # never scaled (no scale tensor): nothing to clear
                scaler.update(new_scale=float(saved["scale"]))
            if _moved(saved, scaler.state_dict()):
                scaler.load_state_dict(saved)


def _cloned(value: Any) -> Any:
    """``value`` with every tensor in it cloned (in dicts, lists and tuples); other objects as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_cloned(v) for v in value)
    return value


def _copy_into(value: Any, saved: Any) -> None:
    """Copy the tensors of ``saved`` (a :func:`_cloned` copy of ``value``) back into ``value``'s, in place."""
    if isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor):
        if value.shape == saved.shape and value.dtype == saved.dtype:
            value.copy_(saved)
    elif isinstance(value, dict) and isinstance(saved, dict):
        for k in value.keys() & saved.keys():
            _copy_into(value[k], saved[k])
    elif isinstance(value, (list, tuple)) and isinstance(saved, (list, tuple)) and len(value) == len(saved):
        for v, c in zip(value, saved, strict=True):
            _copy_into(v, c)


def _same(a: Any, b: Any) -> bool:
    """Whether two recorded values are bitwise the same: tensors by dtype, shape and values (NaN equal to
    NaN), containers element by element, other values by identity or ``==``."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return False
        if torch.equal(a, b):
            return True
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # NaN
        return True
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a bool (an array): only identity counts
        return False


def _moved(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The keys of ``now`` that differ from ``saved``, as ``"key old -> new"`` (the first three; public
    names first), or ``""``."""
    keys = sorted(dict.fromkeys([*saved, *now]), key=lambda k: str(k).startswith("_"))
    moved = [
        f"{key} {_shown(saved.get(key, _NONE))} -> {_shown(now.get(key, _NONE))}"
        if _plain(saved.get(key)) and _plain(now.get(key))
        else f"{key} changed"
        for key in keys
        if key not in saved or key not in now or not _same(saved[key], now[key])
    ]
    return ", ".join(moved[:3]) + (f" (and {len(moved) - 3} more)" if len(moved) > 3 else "")


_NONE = "(none)"  # a key that is not there, in a message


def _plain(value: Any) -> bool:
    """Whether a message shows ``value`` (a number, a one-element tensor, or a short list or tuple of them)
    or only says it changed (a sub-scheduler's state, ...)."""
    if isinstance(value, (list, tuple)):
        return len(value) <= 4 and all(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return value is None or isinstance(value, (bool, int, float, str))


def _shown(value: Any) -> str:
    """A recorded value in a message: a one-element tensor as its number, anything else cut short."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return repr(value.item())
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_shown(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return value if value is _NONE else short(value, limit=40)

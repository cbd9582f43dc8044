"""The checks :func:`~speedups.load_checkpoint` runs on every entry before it changes any object.

Each check either raises or returns the value to load (a model's state dict with any wrapper prefix
removed). Models: the same keys and shapes. Optimizers: the same class, the same hyperparameter keys in
each parameter group, the same group sizes, state shaped like the parameters. LR schedulers: the same class
and keys. ``speedups`` objects (loader, step, tracker, mixed_precision): their own ``_check_state``. Other
objects are checked by their ``load_state_dict``, which ``load_checkpoint`` undoes if a later one fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from speedups._helpers import env
from speedups._helpers.wrappers import strip_prefixes
from speedups.data.distributed_loader import DistributedLoader
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["check_class", "check_entry", "is_checked"]

# Keys a parameter group may gain or lose across torch versions or from an LR scheduler, which the
# optimizer fills in itself when missing (``__setstate__`` defaults, ``setdefault("initial_lr")``).
_OPTIONAL_GROUP_KEYS = frozenset(
    {"initial_lr", "foreach", "fused", "differentiable", "capturable", "maximize", "decoupled_weight_decay",
     "param_names"}
)  # fmt: skip

_LRScheduler = torch.optim.lr_scheduler.LRScheduler


def has_own_check(obj: Any) -> bool:
    """Whether ``obj`` is a speedups object that checks its own saved state (a step, a tracker, ...)."""
    return callable(getattr(type(obj), "_check_state", None))


def is_checked(obj: Any) -> bool:
    """Whether :func:`check_entry` fully checks ``obj`` (no undo copy needed when loading it)."""
    return isinstance(obj, (nn.Module, torch.optim.Optimizer, _LRScheduler)) or has_own_check(obj)


def check_entry(
    said: str, name: str, entry: str, obj: Any, saved: Any, saved_class: str | None, *, strict: bool = True,
    depth: int = 1,
) -> Any:  # fmt: skip
    """Check that ``obj`` (already unwrapped) accepts ``saved``; return what to pass to its load_state_dict.

    ``name`` is the argument (``model``), ``entry`` the file's entry it reads (the same, or from ``keys=``),
    ``saved_class`` the class name recorded when saving (None or "" when the file does not say). ``strict``
    False: a model gets the entries it has (same name and shape), the others are named in one warning, at
    ``depth`` frames above the loading function's caller.
    """
    what = name if entry == name else f"{name} (entry {entry!r})"
    if isinstance(obj, nn.Module):
        return _check_model(said, what, obj, saved) if strict else _matching(said, what, obj, saved, depth)
    if isinstance(obj, torch.optim.Optimizer):
        check_class(said, what, obj, saved_class, "optimizer")
        _check_optimizer(said, what, obj, saved)
    elif isinstance(obj, _LRScheduler):
        check_class(said, what, obj, saved_class, "scheduler")
        own = obj.state_dict()
        if not isinstance(saved, Mapping) or set(saved) != set(own):
            got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
            raise SpeedupsError(
                f"{said}: {what} holds {got}, but this {type(obj).__name__}'s state has {sorted(own)}. "
                f"Build the same scheduler before loading."
            )
    elif isinstance(obj, DistributedLoader) and isinstance(saved, Mapping):
        world = obj.distributed_sampler.num_replicas
        if saved.get("batches") and saved.get("world_size") != world:
            raise SpeedupsError(
                f"{said}: loader {what} was saved mid-epoch with world size {saved.get('world_size')} and "
                f"is loaded with {world}: the batches would not line up. Resume with the same world size."
            )
    if has_own_check(obj):
        try:
            obj._check_state(saved)
        except (TypeError, ValueError, SpeedupsError) as err:
            raise type(err)(f"{said}: {what}: {err}") from err
    return saved


def check_class(said: str, what: str, obj: Any, saved_class: str | None, kind: str) -> None:
    """Raise ``SpeedupsError`` if ``obj`` (an optimizer or scheduler) is not of the class it was saved from
    (``saved_class``; None: not recorded, nothing checked)."""
    here = type(obj).__name__
    if saved_class and saved_class != here:
        raise SpeedupsError(
            f"{said}: {what} was saved from {kind} class {saved_class}, and this one is a {here}: its "
            f"state would not fit. Build a {saved_class} before loading, or leave {kind} out of "
            f"load_checkpoint to start it afresh."
        )


def _check_model(said: str, what: str, model: nn.Module, saved: Any) -> dict[str, Any]:
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        raise SpeedupsError(
            f"{said}: {what} is a {type(saved).__name__}, not a model's state_dict (a dict of tensors by "
            f"parameter name). Point keys= at the entry that holds it, e.g. keys={{'model': 'state_dict'}}."
        )
    own = model.state_dict()
    state = strip_prefixes(saved, expected=own)  # a file written by DDP or torch.compile elsewhere
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise SpeedupsError(
            f"{said}: {what}'s keys differ from this {type(model).__name__}'s: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. The checkpoint was saved from another model "
            f"(wrapper prefixes such as 'module.' and '_orig_mod.' are already removed): build that model "
            f"before loading."
        )
    for key, value in own.items():
        there = state[key]
        if isinstance(value, torch.Tensor) and (
            not isinstance(there, torch.Tensor) or tuple(value.shape) != tuple(there.shape)
        ):
            shape = tuple(there.shape) if isinstance(there, torch.Tensor) else type(there).__name__
            raise SpeedupsError(
                f"{said}: {what.split(' ')[0]}.{key} has shape {tuple(value.shape)} here and {shape} in the "
                f"checkpoint. Build the same model before loading."
            )
    return state


def _matching(said: str, what: str, model: nn.Module, saved: Any, depth: int = 1) -> dict[str, Any]:
    """The entries of ``saved`` that ``model`` has, with the same shape; a warning (rank 0) names the rest."""
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) for k in saved):
        _check_model(said, what, model, saved)  # raises its message
    own = model.state_dict()
    state = strip_prefixes(saved, expected=own)
    mismatched = sorted(
        key for key, value in own.items() if key in state and isinstance(value, torch.Tensor)
        and (not isinstance(state[key], torch.Tensor) or tuple(value.shape) != tuple(state[key].shape))
    )  # fmt: skip
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    loaded = len(own) - len(missing) - len(mismatched)
    if own and not loaded:
        raise SpeedupsError(
            f"{said}: strict=False: none of {what}'s {len(own)} entries is in the checkpoint with its shape "
            f"(it holds {_few(sorted(state))}): another model, or keys= pointing at the wrong entry."
        )
    if (missing or unexpected or mismatched) and env.rank() == 0:
        warnings.warn(
            f"{said}: strict=False: {what} loaded {loaded} of {len(own)} entries; these keep their current "
            f"values: missing from the file {_few(missing)}, another shape {_few(mismatched)}; unused from "
            f"the file: {_few(unexpected)}.",
            SpeedupsWarning,
            stacklevel=4 + depth,  # _matching, check_entry, the comprehension, the loading calls, the caller
        )
    return {key: value for key, value in state.items() if key in own and key not in mismatched}


def _few(keys: list[str]) -> str:
    return f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"


def _check_optimizer(said: str, what: str, opt: torch.optim.Optimizer, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if (
        not isinstance(groups, list)
        or not isinstance(saved.get("state"), Mapping)
        or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise SpeedupsError(
            f"{said}: {what} is not an optimizer's state_dict (a dict with 'state' and 'param_groups'). "
            f"Point keys= at the entry that holds it, e.g. keys={{'optimizer': 'optimizer_state'}}."
        )
    here = [len(g["params"]) for g in opt.param_groups]
    there = [len(g["params"]) for g in groups]
    if here != there:
        raise SpeedupsError(
            f"{said}: optimizer {what} has parameter groups of sizes {here} here and {there} in the "
            f"checkpoint. Build the optimizer over the same parameters before loading."
        )
    for i, (mine, theirs) in enumerate(zip(opt.param_groups, groups, strict=True)):
        lacking = sorted(set(mine) - set(theirs) - _OPTIONAL_GROUP_KEYS)
        extra = sorted(set(theirs) - set(mine) - _OPTIONAL_GROUP_KEYS)
        if lacking or extra:
            raise SpeedupsError(
                f"{said}: optimizer {what}'s parameter group {i} has hyperparameters {extra} in the "
                f"checkpoint that this {type(opt).__name__} lacks, and lacks {lacking}: it was saved from "
                f"another optimizer class. Build the same optimizer before loading, or leave it out of "
                f"load_checkpoint to start it afresh."
            )
    params = [p for g in opt.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    state = saved["state"]
    for param, index in zip(params, ids, strict=True):
        entry = state.get(index, {})
        if not isinstance(entry, Mapping):
            raise SpeedupsError(f"{said}: optimizer {what}'s state of parameter {index} is not a dict.")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise SpeedupsError(
                    f"{said}: optimizer {what}'s state {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)} in the checkpoint, the parameter {tuple(param.shape)} here. "
                    f"Build the optimizer over the same model before loading."
                )

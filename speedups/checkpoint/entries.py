"""What a checkpoint holds by name: stateful objects and plain values, and where they are written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from speedups._helpers import env
from speedups._helpers.validate import short
from speedups._helpers.wrappers import unwrap
from speedups.data.prefetching import DevicePrefetcher

__all__ = [
    "check_path",
    "collective",
    "fsdp_type",
    "holds_fsdp",
    "is_plain",
    "refuse_positional",
    "saved_object",
    "split_state",
]

_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def collective() -> bool:
    """Whether a process group of more than one rank runs: checkpoint calls are then collective."""
    return env.pg_ready() and torch.distributed.get_world_size() > 1


def fsdp_type() -> type | None:
    """FSDP2's ``FSDPModule`` class, or None in a torch without it."""
    return getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)


def holds_fsdp(objects: Mapping[str, Any]) -> bool:
    """Whether an FSDP2 model is among ``objects`` (its checkpoint is then a directory of shards)."""
    fsdp = fsdp_type()
    return fsdp is not None and any(isinstance(o, fsdp) for o in objects.values())


def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data a checkpoint stores as it is: None, numbers, strings, tensors, and
    lists, tuples and dicts (with string keys) of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def split_state(
    call: str, state: Mapping[str, Any], *, allow_empty: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the keyword arguments of ``call`` into stateful objects and plain values, by name.

    Raises:
        TypeError: a value is neither (the message gives the fix, e.g. for a plain DataLoader).
        ValueError: a name starts with ``_``, or nothing was passed (unless ``allow_empty``).
    """
    objects, plain = {}, {}
    for name, value in state.items():
        if name.startswith("_"):
            raise ValueError(f"{call}({name}=...): names starting with '_' are reserved. Rename it.")
        if _is_stateful(saved_object(value)):
            objects[name] = value
        elif is_plain(value):
            plain[name] = value
        else:
            fix = f"Pass its state as a plain value instead, e.g. {name}={name}.get_state() for a Generator."
            if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a NumPy number or array
                fix = f"Pass it as Python data: {name}={name}.item() (a number) or {name}.tolist() (arrays)."
            elif isinstance(value, dict):
                fix = "Dicts keep string keys (as JSON), e.g. {'1': ...} for {1: ...}."
            if isinstance(saved_object(value), DataLoader):
                fix = (
                    f"A plain DataLoader has no state (no position to resume from): build it once, before "
                    f"the loop, as {name} = distributed({name}, seed=0) (it works in one process too; its "
                    f"shuffle comes from seed + epoch), iterate that, and pass it."
                )
            raise TypeError(
                f"{call}({name}={type(value).__name__}): expected an object with state_dict() and "
                f"load_state_dict() (model, optimizer, scheduler, DistributedLoader, LossTracker, ...) or a "
                f"plain value (number, string, tensor, list/dict of them). {fix}"
            )
    if not state and not allow_empty:
        raise ValueError(f"{call}(path): nothing to save or load. Pass objects by name, e.g. model=model.")
    return objects, plain


def check_path(call: str, path: Any) -> Path:
    """``path`` as a ``Path``; a TypeError or ValueError naming ``path`` when it is no file name."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        error = ValueError if isinstance(path, str) else TypeError
        raise error(
            f"{call}(path={short(path)}): expected the checkpoint's file name, a non-empty str or "
            f"pathlib.Path. Write {call}('checkpoints/last.pt', ...)."
        )
    return Path(path)


def saved_object(obj: Any) -> Any:
    """The object whose state is saved: a model without its DDP / DataParallel / torch.compile wrappers, a
    loader without its ``prefetch_to_device``."""
    if isinstance(obj, DevicePrefetcher):
        return obj.loader
    return unwrap(obj) if isinstance(obj, nn.Module) else obj


def refuse_positional(call: str, objects: tuple[Any, ...]) -> None:
    """Objects given by position (``save_checkpoint(path, model)``) have no name to be saved or found under.

    Raises:
        TypeError: ``objects`` is not empty (the message suggests names from the objects' kinds).
    """
    if not objects:
        return
    names = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            names.append("model=model")
        elif isinstance(obj, torch.optim.Optimizer):
            names.append("optimizer=optimizer")
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            names.append("scheduler=scheduler")
        else:
            names.append(f"{type(obj).__name__.lower()}=...")
    kinds = ", ".join(type(o).__name__ for o in objects)
    raise TypeError(
        f"{call}(path, <{kinds}>): objects go by name, the name they are saved under and loaded from. "
        f"Write {call}(path, {', '.join(names)})."
    )

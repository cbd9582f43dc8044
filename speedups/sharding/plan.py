"""The validated plan of a ``shard_model`` call: which submodule goes to which device(s), checked in full.

Everything :func:`~speedups.shard_model` refuses is refused here, before anything moves or is registered.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from speedups._helpers.moving import DeviceLike
from speedups.device import resolve_device
from speedups.errors import SpeedupsError

__all__ = ["INSIDE_ATTR", "PLAN_ATTR", "Shard", "Sharding", "make_plan", "named_tensors"]

PLAN_ATTR = "_speedups_sharding"  # the plan of a sharded model, kept on the model itself (nothing global)
INSIDE_ATTR = "_speedups_inside_sharding"  # set on every submodule of a sharded model


@dataclasses.dataclass(frozen=True)
class Shard:
    key: str
    devices: tuple[torch.device, ...]
    replicated: bool  # a list of devices was given: the submodule is wrapped in nn.DataParallel

    @property
    def device(self) -> torch.device:
        return self.devices[0]


@dataclasses.dataclass
class Sharding:
    shards: dict[str, Shard]
    compute_device: torch.device  # where everything not under a key lives and runs
    output_device: torch.device | None  # None: the device of the first input tensor, per call
    original_device: torch.device | None  # the one device the model was on before, if it was on one
    handles: list[RemovableHandle] = dataclasses.field(default_factory=list)
    wrappers: list[tuple[nn.Module, str, nn.DataParallel]] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------------------- validation
def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def make_plan(
    model: nn.Module,
    device_map: Mapping[str, Any],
    default_device: DeviceLike | None,
    output_device: DeviceLike | None,
) -> Sharding:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"shard_model({type(model).__name__}, ...): expected an nn.Module as `model`, "
            f"got {type(model).__name__}. Pass the model itself: shard_model(model, {{'encoder': 0}})."
        )
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"shard_model(model, {device_map!r}): `device_map` must be a dict of submodule name to device, "
            f"got {type(device_map).__name__}. E.g. shard_model(model, {{'encoder': 0, 'decoder': 1}})."
        )
    said = f"shard_model(model, {dict(device_map)!r})"
    if model.__dict__.get(INSIDE_ATTR):
        raise SpeedupsError(
            f"{said}: this model is a submodule of a sharded model, whose hooks already move its inputs. "
            f"Sharding it too would stack hooks. Undo the parent first (unshard_model(parent)), then shard "
            f"the parent once with the whole map, e.g. {{'inner.0': 'cuda:0'}}."
        )
    for name, module in model.named_modules():
        if isinstance(getattr(module, PLAN_ATTR, None), Sharding):
            where = "model" if not name else f"model.{name}"
            raise SpeedupsError(
                f"{said}: {where} is already sharded. Sharding twice would stack hooks. "
                f"Undo first: unshard_model({where}), then shard_model(model, ...) once with the whole map."
            )
    if not device_map:
        raise ValueError(
            f"{said}: `device_map` is empty, so nothing would be sharded. Name at least one submodule: "
            f"shard_model(model, {{{_example_name(model)!r}: 0}}), or move the whole model: model.to(device)."
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    for key in device_map:
        _check_key(model, modules, key, said)
    _check_overlaps(modules, list(device_map), said)
    shards = {key: _resolve_value(key, value, said) for key, value in device_map.items()}
    first = next(iter(shards.values())).device
    compute = first if default_device is None else _resolve(default_device, "default_device")
    output = None if output_device is None else _resolve(output_device, "output_device")
    _check_tensors(model, shards, compute, said)
    devices = {t.device for _, t in named_tensors(model)}
    original = next(iter(devices)) if len(devices) == 1 else None
    return Sharding(shards, compute, output, original)


def _resolve(device: DeviceLike, argument: str) -> torch.device:
    return resolve_device(device, call="shard_model", argument=argument)


def _example_name(model: nn.Module) -> str:
    return next((name for name, _ in model.named_children()), "encoder")


def _check_key(model: nn.Module, modules: dict[str, nn.Module], key: object, said: str) -> None:
    if not isinstance(key, str):
        raise TypeError(
            f"{said}: key {key!r} is a {type(key).__name__}; keys are dotted submodule names (str) such as "
            f"{_example_name(model)!r}. Use shard_model(model, {{{_example_name(model)!r}: 0}})."
        )
    if key == "":
        raise ValueError(
            f"{said}: the key '' is the model itself, not a submodule. Name submodules, e.g. "
            f"{{{_example_name(model)!r}: 0}}, or put the whole model on one device: model.to(device)."
        )
    if key in modules:
        return
    names = [n for n in modules if n]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    shown = ", ".join(repr(n) for n in names[:20])
    if len(names) > 20:
        shown += f", ... ({len(names)} names)"
    fix = close[0] if close else (names[0] if names else "")
    raise ValueError(
        f"{said}: {key!r} is not a submodule of {type(model).__name__}. {hint}Keys are dotted names from "
        f"model.named_modules(): {shown or 'none (this model has no submodules)'}. "
        f"Use e.g. shard_model(model, {{{fix!r}: 0}})."
    )


def _check_overlaps(modules: dict[str, nn.Module], keys: list[str], said: str) -> None:
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            outer, inner = (a, b) if b.startswith(a + ".") else (b, a)
            if inner.startswith(outer + "."):
                raise ValueError(
                    f"{said}: keys {outer!r} and {inner!r} overlap ({inner!r} lies inside {outer!r}). "
                    f"Each submodule is placed once. Keep one of them, or map siblings of {inner!r} instead "
                    f"of {outer!r}: shard_model(model, {{{inner!r}: ..., <its siblings>: ...}})."
                )
            if modules[a] is modules[b]:
                raise ValueError(
                    f"{said}: keys {a!r} and {b!r} name the same module object (it is registered twice). "
                    f"A module lives on one device. Keep one key: shard_model(model, {{{a!r}: ...}})."
                )


def _resolve_value(key: str, value: object, said: str) -> Shard:
    argument = f"device_map[{key!r}]"
    if isinstance(value, (list, tuple)):
        return Shard(key, _resolve_replicas(key, value, said), replicated=True)
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise TypeError(
            f"{said}: {argument} is {value!r} ({type(value).__name__}). A device is an int (CUDA index), a "
            f"string such as 'cuda:0' or 'cpu', a torch.device, or a list of CUDA devices to replicate with "
            f"nn.DataParallel. E.g. shard_model(model, {{{key!r}: 'cpu'}})."
        )
    return Shard(key, (_resolve(value, argument),), replicated=False)


def _resolve_replicas(key: str, value: Sequence[Any], said: str) -> tuple[torch.device, ...]:
    argument = f"device_map[{key!r}]"
    if not value:
        raise ValueError(
            f"{said}: {argument} is an empty list. A list names the CUDA devices that replicate {key!r} with "
            f"nn.DataParallel. Give at least one: shard_model(model, {{{key!r}: [0, 1]}}), or one device."
        )
    devices: list[torch.device] = []
    for i, item in enumerate(value):
        if isinstance(item, (list, tuple)):
            raise TypeError(f"{said}: {argument}[{i}] is a {type(item).__name__}; lists do not nest.")
        device = _resolve(item, f"{argument}[{i}]")
        if device.type != "cuda":
            raise ValueError(
                f"{said}: {argument}[{i}] is {str(device)!r}; replicas use nn.DataParallel, which runs on "
                f"CUDA devices only. Put {key!r} on that one device instead: shard_model(model, "
                f"{{{key!r}: {str(device)!r}}})."
            )
        if device in devices:
            raise ValueError(
                f"{said}: {argument} lists {str(device)!r} twice. Each replica needs its own GPU: "
                f"shard_model(model, {{{key!r}: {sorted({d.index for d in devices} | {device.index})}}})."
            )
        devices.append(device)
    return tuple(devices)


def _group(name: str, shards: Mapping[str, Shard]) -> str | None:
    return next((key for key in shards if name.startswith(key + ".")), None)


def _check_tensors(model: nn.Module, shards: Mapping[str, Shard], compute: torch.device, said: str) -> None:
    seen: dict[int, tuple[str, torch.device]] = {}
    for name, tensor in named_tensors(model):
        group = _group(name, shards)
        target = compute if group is None else shards[group].device
        if tensor.is_meta and target.type != "meta":
            raise SpeedupsError(
                f"{said}: {name!r} is on 'meta', which holds no data, and would move to {str(target)!r}. "
                f"Map it to 'meta', or materialise the model first: model.to_empty(device=...) and load a "
                f"state_dict."
            )
        first = seen.setdefault(id(tensor), (name, target))
        if first[1] != target:
            raise ValueError(
                f"{said}: {first[0]!r} and {name!r} are the same tensor (tied weights) but would go to "
                f"{str(first[1])!r} and {str(target)!r}. A tensor lives on one device. Map the modules that "
                f"share it to the same device, or put them under one key."
            )

"""Tip 8: model parallel by submodule name, with inputs moved for you and data-parallel replicas per shard.

When a model does not fit one device, the classic move is to put the encoder on one GPU and the decoder on
another and to move activations between them by hand (PyTorch tutorial "Single-Machine Model Parallel Best
Practices"). Done by hand it breaks on the details: a parameter on the root module, a keyword argument such
as a mask, an output left on an unexpected device. :func:`shard_model` does the moving with official,
removable module hooks and returns the same ``nn.Module``; :func:`unshard_model` undoes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from torch import nn

from speedups._helpers import compat, validate
from speedups._helpers.moving import DeviceLike
from speedups.device import resolve_device
from speedups.errors import SpeedupsError
from speedups.sharding.hooks import MoveInputs, MoveOutput, RootIO, UnwrapStateDict, WrapStateDict
from speedups.sharding.plan import INSIDE_ATTR, PLAN_ATTR, Sharding, make_plan, named_tensors

__all__ = ["shard_model", "unshard_model"]

M = TypeVar("M", bound=nn.Module)


def shard_model(
    model: M,
    device_map: Mapping[str, DeviceLike | Sequence[DeviceLike]],
    *,
    default_device: DeviceLike | None = None,
    output_device: DeviceLike | None = None,
    enabled: bool = True,
) -> M:
    """Place submodules of ``model`` on devices by name, and move activations between them for you.

    Model parallelism with hooks: each mapped submodule moves to its device; a forward pre-hook moves its
    inputs there (any nesting, as :func:`~speedups.to_device` does) and a forward hook brings its output back
    to ``default_device``, where the unmapped code runs, so ``forward`` runs unchanged. A list of CUDA
    devices replicates that submodule with ``nn.DataParallel``. It saves memory per device, not time (shards
    run one after another; each crossing is a copy). Gradients equal the unsharded model's; build the
    optimizer after sharding. ``state_dict()`` keys are the unsharded model's (also under DataParallel).
    Only calls through ``module(...)`` are hooked; tied tensors cannot span two devices.
    Sync points: none on the host; a CUDA-to-CPU copy waits for the GPU, as ``.cpu()`` does.

    Args:
        model: the model; changed in place and returned. A ``torch.compile`` wrapper is seen through: the
            module inside it is sharded (names as in the plain model) and the wrapper returned.
        device_map: ``{dotted submodule name: device}``, e.g. ``{"encoder": 0, "decoder.layers.3": "cpu"}``.
            Names are those of ``model.named_modules()`` (not ``""``, the model itself); no key may lie inside
            another. A device is an int (a CUDA index), a string such as ``"cuda:1"``, ``"cpu"``, ``"meta"``,
            a ``torch.device``, or a list of CUDA devices (``[0, 1]``) to replicate that submodule across them
            with ``nn.DataParallel``.
        default_device: the device of every parameter and buffer not under a key, where the unmapped code
            runs. Default: the (first) device of the first key.
        output_device: where the model's output goes. Default (None): the device of the first tensor in
            the call's inputs (positional first, then keyword), or ``default_device`` if there is none.
        enabled: False returns ``model`` untouched.

    Returns:
        ``model`` itself, sharded. Undo with :func:`unshard_model`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``device_map`` is not a mapping, or a key or value
            has the wrong type.
        ValueError: ``device_map`` is empty, a key is not a submodule name (the message lists the valid
            ones), keys overlap or name the same module, a list of devices is empty, repeats a device or
            holds a non-CUDA device, or a tied tensor would go to two devices.
        SpeedupsError: a device does not exist here (the message lists what does), ``model`` (or a
            submodule) is already sharded, or a tensor on ``meta`` would have to move to a real device.
            Nothing is moved or registered when it raises.

    Example:
        >>> import torch
        >>> from collections import OrderedDict
        >>> model = nn.Sequential(OrderedDict(encoder=nn.Linear(4, 8), decoder=nn.Linear(8, 2)))
        >>> model = shard_model(model, {"encoder": "meta", "decoder": "meta"})
        >>> model.encoder.weight.device, model(torch.ones(3, 4, device="meta")).shape
        (device(type='meta'), torch.Size([3, 2]))
        >>> unshard_model(model, "meta").encoder.weight.device   # hooks removed, one device again
        device(type='meta')
    """
    with validate.arguments("shard_model(model, device_map)"):
        validate.flag(enabled, "enabled")
    if not enabled:
        return model
    plain = _compiled_inner(model)  # torch.compile(model): shard the module it runs, keys as unsharded
    plan = make_plan(plain, device_map, default_device, output_device)
    _apply(plain, plan)
    return model


def _compiled_inner(model: M) -> M:
    """The module inside any ``torch.compile`` wrappers of ``model`` (``model`` itself when not compiled)."""
    inner: Any = model
    while (next_inner := compat.compiled_inner(inner)) is not None:
        inner = next_inner
    return inner


def unshard_model(model: M, device: DeviceLike | None = None) -> M:
    """Undo :func:`shard_model`: remove its hooks, unwrap ``nn.DataParallel`` replicas, move to one device.

    Args:
        model: a model returned by :func:`shard_model`.
        device: where the whole model goes. Default: the one device it was on before sharding, or, if it
            was spread over several, the sharding's ``default_device``.

    Returns:
        ``model`` itself, as an ordinary module on ``device`` (build a new optimizer if the device changed).

    Raises:
        SpeedupsError: ``model`` is not sharded, ``device`` does not exist here, or a tensor on ``meta``
            would have to move to a real device.
        TypeError, ValueError: ``device`` is not a device.

    Nothing is changed when it raises.
    """
    compiled, model = model, _compiled_inner(model)
    plan = getattr(model, PLAN_ATTR, None)
    if not isinstance(plan, Sharding):
        raise SpeedupsError(
            f"unshard_model({type(model).__name__}): this model is not sharded. "
            f"Only a model returned by shard_model() can be unsharded; to move a model use model.to(device)."
        )
    if device is None:
        target = plan.original_device or plan.compute_device
    else:
        target = resolve_device(device, call="unshard_model", argument="device")
    if target.type != "meta":
        for name, tensor in named_tensors(model):
            if tensor.is_meta:
                raise SpeedupsError(
                    f"unshard_model(model, device={str(target)!r}): {name!r} is on 'meta', which holds no "
                    f"data to copy. Keep it on meta, or materialise first: model.to_empty(device=...) and "
                    f"load a state_dict."
                )
    for handle in plan.handles:
        handle.remove()
    for parent, name, wrapper in plan.wrappers:
        setattr(parent, name, wrapper.module)
    delattr(model, PLAN_ATTR)
    for module in model.modules():
        if INSIDE_ATTR in module.__dict__:
            delattr(module, INSIDE_ATTR)
    model.to(target)
    return compiled


# ---------------------------------------------------------------------------------------------- applying
def _parent(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    parent_name, _, name = key.rpartition(".")
    return model.get_submodule(parent_name), name


def _ties(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Return the (module name, attribute) places of each tensor registered in more than one place."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, tensor in named_tensors(model):
        owner, _, attr = name.rpartition(".")
        places.setdefault(id(tensor), []).append((owner, attr))
    return [group for group in places.values() if len(group) > 1]


def _apply(model: nn.Module, plan: Sharding) -> None:
    # Mapped submodules first, each straight to its device (a model too big for one device never has to fit
    # on one). Then everything else, with the mapped submodules unhooked from the tree for that one call, so
    # that nn.Module.to moves exactly the rest (tied tensors were checked to agree).
    ties = _ties(model)
    for key, shard in plan.shards.items():
        model.get_submodule(key).to(shard.device)
    detached = [(shard, *_parent(model, key), model.get_submodule(key)) for key, shard in plan.shards.items()]
    for _, parent, name, _ in detached:
        setattr(parent, name, None)
    try:
        model.to(plan.compute_device)
    finally:
        for _, parent, name, module in detached:
            setattr(parent, name, module)
    # A move that cannot reuse the tensor (cpu to meta, say) makes a new Parameter per module, which would
    # untie shared weights (plain nn.Module.to does the same); tie them again (they were checked to agree).
    for (owner, attr), *others in ties:
        tensor = getattr(model.get_submodule(owner), attr)
        for other, other_attr in others:
            setattr(model.get_submodule(other), other_attr, tensor)

    for shard, parent, name, module in detached:
        target = module
        if shard.replicated:
            wrapper = nn.DataParallel(
                module, device_ids=[d.index for d in shard.devices], output_device=shard.device
            )
            setattr(parent, name, wrapper)
            plan.wrappers.append((parent, name, wrapper))
            plan.handles.append(compat.register_state_dict_post_hook(wrapper, UnwrapStateDict()))
            plan.handles.append(compat.register_load_state_dict_pre_hook(wrapper, WrapStateDict()))
            target = wrapper
        plan.handles.append(
            target.register_forward_pre_hook(MoveInputs(shard.device), with_kwargs=True, prepend=True)
        )
        plan.handles.append(target.register_forward_hook(MoveOutput(plan.compute_device), with_kwargs=True))
    root = RootIO(plan.compute_device, plan.output_device)
    plan.handles.append(model.register_forward_pre_hook(root.before, with_kwargs=True, prepend=True))
    plan.handles.append(model.register_forward_hook(root.after, with_kwargs=True))
    setattr(model, PLAN_ATTR, plan)
    for name, module in model.named_modules():
        if name:  # a submodule of a sharded model must not be sharded on its own: its hooks would stack
            object.__setattr__(module, INSIDE_ATTR, True)

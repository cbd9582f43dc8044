"""Tip 9, the model half: :func:`ddp_wrap` puts the model on this process's device, in DDP or FSDP2.

The data half (:func:`~speedups.distributed`) is in :mod:`speedups.data.distributed_loader`. Without a
launcher the model is returned on its device, unwrapped, so one script runs with and without torchrun.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from speedups._helpers import env
from speedups._helpers.moving import DeviceLike
from speedups._helpers.wrappers import find_ddp, layers, unwrap
from speedups.device import default_device, resolve_device
from speedups.errors import SpeedupsError
from speedups.parallel import rendezvous
from speedups.parallel.process_group import DEFAULT_TIMEOUT_S, start_process_group

__all__ = ["ddp_wrap"]


def _fully_shard() -> Callable[..., Any] | None:
    fsdp = getattr(torch.distributed, "fsdp", None)
    if fsdp is None:
        try:
            import torch.distributed.fsdp as fsdp
        except ImportError:
            return None
    return getattr(fsdp, "fully_shard", None)


def ddp_wrap(
    model: nn.Module, *, strategy: str = "ddp", device: DeviceLike | None = None, **kwargs: Any
) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for data parallelism across the process group.

    Initialises the process group from the environment first if needed (:func:`init_distributed`). The
    device is ``device`` if given (it overrides every launcher), else this process's device by one rule for
    every launch style (:func:`~speedups.default_device`: ``cuda:LOCAL_RANK`` under torchrun or
    :func:`~speedups.launch`, never the global rank; ``cuda:0`` with one GPU per ``srun`` task; the current
    device after ``torch.cuda.set_device`` in ``mp.spawn``), else the CPU. ``strategy="ddp"`` wraps
    in ``torch.nn.parallel.DistributedDataParallel`` (``device_ids=[LOCAL_RANK]`` on CUDA): every rank holds
    the whole model and one all-reduce of the gradients per backward averages them, so N ranks each doing a
    batch of B equal one process doing the global batch of N*B. ``strategy="fsdp"`` applies FSDP2
    ``fully_shard`` (parameters, gradients and optimizer state sharded across ranks; it returns the same
    module object, now an ``FSDPModule``). Without a process group (world size 1) the model is returned on its
    device, unwrapped, so one script runs with and without torchrun. With ``@accumulate`` the wrapped model's
    ``no_sync`` / ``set_requires_gradient_sync`` skip the all-reduce inside an accumulation window.

    When it does not help: one process, or a model too small for the all-reduce to hide behind compute.
    Source: PyTorch's DDP notes (https://pytorch.org/docs/stable/notes/ddp.html) and the FSDP2 docs.

    Args:
        model: the module to train; at least one parameter must require grad. A compiled one
            (``torch.compile(m)``) is wrapped as ``DDP(compiled)`` (FSDP2 shards the module inside it);
            ``torch.compile(ddp_wrap(m))`` is the order PyTorch recommends. ``@accumulate`` and ``check()``
            see through either order.
        strategy: ``"ddp"`` or ``"fsdp"``.
        device: where this process's replica lives (``"cuda:1"``, ``torch.device``, an int); None uses
            :func:`~speedups.default_device`. With CUDA it also becomes the current device.
        **kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``) or to
            ``fully_shard`` (e.g. ``reshard_after_forward=False``); checked against their signatures first.

    Returns:
        The wrapped model (DDP: a new module whose ``.module`` is yours; FSDP2: your module, sharded), or
        ``model`` on its device when there is one process.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, it is already wrapped, or ``kwargs`` has a name the
            wrapper does not take.
        ValueError: ``strategy`` is not ``"ddp"``/``"fsdp"``, or no parameter requires grad.
        SpeedupsError: FSDP2 is not in this torch, the environment contradicts itself, or ``LOCAL_RANK`` is
            beyond the GPUs present. In every case the model is left untouched.

    Example:
        >>> net = ddp_wrap(nn.Linear(3, 1))   # a plain process: on its device, unwrapped
        >>> type(net).__name__
        'Linear'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"ddp_wrap(model={type(model).__name__}): expected a torch.nn.Module. Pass the model itself."
        )
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(
            f"ddp_wrap(strategy={strategy!r}): unknown strategy. "
            f"Use 'ddp' (replicas) or 'fsdp' (FSDP2 sharding)."
        )
    if find_ddp(model) is not None or any(_is_fsdp(layer) for layer in layers(model)):
        raise TypeError(
            f"ddp_wrap(model={type(model).__name__}): the model is already wrapped (DDP or FSDP2, maybe "
            f"inside torch.compile). Pass the plain module, once: torch.compile(ddp_wrap(model))."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"ddp_wrap(model={type(model).__name__}): no parameter requires grad, so there is nothing to "
            f"synchronise. Unfreeze some (p.requires_grad_(True)) or skip ddp_wrap for a frozen model."
        )
    target: Callable[..., Any]
    if strategy == "fsdp":
        shard = _fully_shard()
        if shard is None:
            raise SpeedupsError(
                "ddp_wrap(strategy='fsdp'): this torch has no torch.distributed.fsdp.fully_shard (FSDP2). "
                "Upgrade torch, or use strategy='ddp'."
            )
        target = shard
    else:
        target = nn.parallel.DistributedDataParallel
    _check_kwargs(target, kwargs, strategy)
    env.placement(call="ddp_wrap()")
    place = default_device() if device is None else resolve_device(device, call="ddp_wrap", argument="device")
    if place.type != "meta" and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(
            f"ddp_wrap(model={type(model).__name__}, device={str(place)!r}): the model is on the meta "
            f"device, so it has no values to move, train or synchronise. Materialise it on a real device "
            f"first: model.to_empty(device='cuda'), then load or initialise its weights."
        )
    if place.type == "cuda":  # also with a process group the user made: collectives use the current device
        torch.cuda.set_device(place)
    running = start_process_group(
        backend=None,
        timeout=DEFAULT_TIMEOUT_S,
        rendezvous_timeout=rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT_S,
        device=place,
    )
    device = place
    model.to(device)
    if not running:
        return model
    if strategy == "fsdp":
        target(unwrap(model), **kwargs)  # FSDP2 shards the plain module in place, also under torch.compile
        return model
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index])
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def _is_fsdp(model: nn.Module) -> bool:
    fsdp_module = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return fsdp_module is not None and isinstance(model, fsdp_module)


def _check_kwargs(target: Callable[..., Any], kwargs: dict[str, Any], strategy: str) -> None:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    allowed = [name for name in params if name not in ("self", "module")]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"ddp_wrap(strategy={strategy!r}, {', '.join(f'{k}=...' for k in unknown)}): "
            f"{getattr(target, '__name__', target)} takes no argument {unknown}. It takes {allowed}."
        )

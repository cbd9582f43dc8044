"""Tip 9, the process half: the process group from torchrun or SLURM, ``ddp_wrap``, and rank-zero helpers.

The step from one process to many is where hand-written loops break quietly: the global rank is used as a
GPU index on the second node, a dead peer hangs the job, every rank prints. This module gives:

- :func:`init_distributed` / :func:`destroy_distributed`: the process group from torchrun's or SLURM's
  variables, with a timeout, and its clean end.
- :func:`ddp_wrap`: the model on this process's device, in ``DistributedDataParallel`` or FSDP2.
- :func:`seed_everything`, :func:`is_main_process`, :func:`rank_zero_only`, :func:`rank_zero_print`.

The data half (:func:`~speedups.distributed`) is in :mod:`speedups.distributed_loader`. The same script runs
unchanged as one plain process: without a launcher everything here is a no-op that returns the model on its
device.
"""

from __future__ import annotations

import builtins
import gc
import inspect
import os
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import wrapt
from torch import nn

from speedups import _env, _rendezvous, _validate
from speedups._wrappers import find_ddp, layers, unwrap
from speedups.device import DeviceLike, default_device, resolve_device
from speedups.errors import SpeedupsError

__all__ = [
    "ddp_wrap",
    "destroy_distributed",
    "init_distributed",
    "is_main_process",
    "rank_zero_only",
    "rank_zero_print",
    "seed_everything",
]

DEFAULT_TIMEOUT_S = 1800.0
"""Seconds a collective may wait for a peer before the job fails (torch's own default for gloo)."""


# ---------------------------------------------------------------------------------------- process group
def init_distributed(
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    rendezvous_timeout: float = _rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT_S,
) -> bool:
    """Initialise the default process group from the environment, once; return whether one is running.

    Reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or SLURM's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, the first host of ``SLURM_JOB_NODELIST`` as the master address,
    ``MASTER_PORT`` or 29500 as the port) when ``srun`` started the process. Nothing is written to
    ``os.environ``. With CUDA the backend is nccl and the current CUDA device is set to this process's device
    (``cuda:LOCAL_RANK`` under torchrun, never the global rank; see :func:`~speedups.default_device`);
    otherwise gloo. A world size of 1 (no launcher; SLURM variables without srun, with one warning)
    initialises nothing and returns False; an already initialised process group is left as it is.

    Joining is separate from the collectives: every rank must join within ``rendezvous_timeout`` (a rank
    still waiting after 10 s says so on stderr), else the call fails naming ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and how many processes joined. ``timeout`` then applies to
    each collective.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or None (nccl with CUDA, gloo otherwise).
        timeout: seconds a collective waits for a peer before failing (default 1800), so a dead peer ends
            the job instead of hanging it. Raise it if rank 0 alone does long work (a huge checkpoint)
            between collectives.
        rendezvous_timeout: seconds all processes may take to join (default 300).

    Returns:
        True when a process group with more than one process is initialised.

    Raises:
        TypeError: ``timeout`` is not a number, or ``backend`` is not a string or None.
        ValueError: ``timeout`` is not positive and finite.
        SpeedupsError: the environment contradicts itself (``RANK >= WORLD_SIZE``, ...), ``LOCAL_RANK``
            names a GPU this machine does not have, or the rendezvous did not complete in time.

    Example:
        >>> init_distributed()  # a plain process: nothing to do
        False
    """
    said = (
        f"init_distributed(backend={backend!r}, timeout={timeout!r}, "
        f"rendezvous_timeout={rendezvous_timeout!r})"
    )
    with _validate.arguments(said):
        _validate.real(timeout, "timeout", positive=True, example="1800 (seconds)")
        _validate.real(rendezvous_timeout, "rendezvous_timeout", positive=True, example="300 (seconds)")
        _validate.instance(backend, str, "backend", what="'nccl', 'gloo'", none_ok=True)
    return _start(backend=backend, timeout=timeout, rendezvous_timeout=rendezvous_timeout, device=None)


def _start(
    *, backend: str | None, timeout: float, rendezvous_timeout: float, device: torch.device | None
) -> bool:
    dist = torch.distributed
    if _env.pg_ready():
        return int(dist.get_world_size()) > 1
    if not dist.is_available():
        return False
    here = _env.placement(call="init_distributed()")
    if here.world_size == 1:
        return False
    if device is None:
        device = default_device()  # validates LOCAL_RANK against the GPUs present, before anything starts
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torchrun (MASTER_ADDR and MASTER_PORT set): env://, which joins torchrun's own store. SLURM alone: the
    # first node of the job, passed explicitly (no env writes).
    url = "env://"
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        url = f"tcp://{_env.master_addr()}:{_env.master_port()}"
    shown = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or f"(unset, used {_env.master_addr()})",
        "MASTER_PORT": os.environ.get("MASTER_PORT") or f"(unset, used {_env.master_port()})",
        "WORLD_SIZE": str(here.world_size),
        "RANK": str(here.rank),
    }
    # After an elastic restart (torchrun --max-restarts) the store may still hold the keys of the attempt
    # that crashed (each rank's address): a prefix per attempt keeps the attempts apart.
    prefix = f"speedups/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = _rendezvous.join(
        url,
        prefix=prefix,
        rank=here.rank,
        world_size=here.world_size,
        timeout_s=float(rendezvous_timeout),
        shown=shown,
        call="init_distributed()",
    )
    wait = timedelta(seconds=float(timeout))
    store.set_timeout(wait)  # from here on, the long collective timeout
    store = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend=backend, store=store, rank=here.rank, world_size=here.world_size, timeout=wait
    )
    return True


def destroy_distributed() -> None:
    """End the job's process group cleanly: collect garbage, wait for every rank, destroy the group.

    Call it once per process at the very end, after the function that held the DDP model has returned
    (the pattern of ``examples/train_ddp.py``: ``accuracy = train(args); destroy_distributed()``). A
    ``DistributedDataParallel`` model still alive when the process group is destroyed makes the process abort
    at exit ("terminate called without an active exception", seen with gloo on torch 2.14 about every other
    run); its reducer is freed by the garbage collection done here, while the group still exists. The
    barrier keeps a fast rank from tearing down its connections while a slow one still talks to it. No-op
    without a process group.

    Sync points: one barrier (a collective: every rank must call it).
    """
    if not _env.pg_ready():
        return
    gc.collect()  # free DDP reducers that only reference cycles keep alive
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def is_main_process() -> bool:
    """Return True on global rank 0 (the process that logs and writes checkpoints), and in a plain run.

    Reads the process group if one is initialised, else ``RANK``/``SLURM_PROCID``. Never the local rank:
    on a second node, local rank 0 is not the main process.

    Example:
        >>> is_main_process()
        True
    """
    return _env.rank() == 0


@wrapt.decorator
def _rank_zero(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    if _env.rank() != 0:
        return None
    return wrapped(*args, **kwargs)


def rank_zero_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a function so it runs on global rank 0 only and returns None elsewhere.

    For logging, writing files and printing. Never decorate a function that runs a collective (all-reduce,
    barrier, ``LossTracker(all_ranks=True).compute()``): the other ranks would wait for it forever (until
    the process group's timeout). Works on methods; the signature is kept. A class is refused: on the other
    ranks its "instance" would be None.

    Raises:
        TypeError: ``fn`` is a class or not callable.

    Example:
        >>> @rank_zero_only
        ... def log(msg):
        ...     return f"logged {msg}"
        >>> log("hi")
        'logged hi'
    """
    if isinstance(fn, type):
        raise TypeError(
            f"rank_zero_only({fn.__qualname__}): a class cannot be rank-zero-only: on every other rank "
            f"{fn.__qualname__}(...) would return None instead of an instance. Decorate its methods instead "
            f"(@rank_zero_only def log(self, ...)), or create the object `if is_main_process():`."
        )
    if not callable(fn):
        raise TypeError(
            f"rank_zero_only({type(fn).__name__}): expected a function or method. "
            f"Write @rank_zero_only above a def."
        )
    return _rank_zero(fn)


def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only: one line per job instead of one per process.

    Example:
        >>> rank_zero_print("epoch", 1)
        epoch 1
    """
    if _env.rank() == 0:
        builtins.print(*args, **kwargs)


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy (if installed), and torch on the CPU and every CUDA device.

    Call it once at the start, with the same seed on every rank: models then start identical (DDP also
    broadcasts rank 0's weights) and :func:`~speedups.distributed` loaders agree on the order. Dropout
    masks are then the same on every rank too; add the rank (``seed + rank``) after wrapping if that
    matters to you.

    Args:
        seed: an int in [0, 2**32 - 1] (NumPy's range).

    Returns:
        The seed.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: ``seed`` is out of range.

    Example:
        >>> _ = seed_everything(3); a = torch.rand(2)
        >>> _ = seed_everything(3); bool((a == torch.rand(2)).all())
        True
    """
    with _validate.arguments(f"seed_everything(seed={seed!r})"):
        fix = "0 (NumPy's range: 0 to 2**32 - 1)"
        _validate.integer(seed, "seed", minimum=0, maximum=2**32 - 1, example=fix)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    return seed


# ---------------------------------------------------------------------------------------------- ddp_wrap
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
    _env.placement(call="ddp_wrap()")
    place = default_device() if device is None else resolve_device(device, call="ddp_wrap", argument="device")
    if place.type != "meta" and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(
            f"ddp_wrap(model={type(model).__name__}, device={str(place)!r}): the model is on the meta "
            f"device, so it has no values to move, train or synchronise. Materialise it on a real device "
            f"first: model.to_empty(device='cuda'), then load or initialise its weights."
        )
    if device is not None and place.type == "cuda":
        torch.cuda.set_device(place)
    running = _start(
        backend=None,
        timeout=DEFAULT_TIMEOUT_S,
        rendezvous_timeout=_rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT_S,
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

"""Tip 9: multi-process and multi-node data parallelism on torch's own engine (torchrun, SLURM).

The step from one process to many is where hand-written loops break quietly: the sampler replays the same
order every epoch because ``set_epoch`` was forgotten; evaluation counts padded duplicates, so the metric
depends on the world size; the global rank is used as a GPU index on the second node. This module gives:

- :func:`init_distributed`: the process group from torchrun's or SLURM's variables, with a timeout.
- :func:`ddp_wrap`: the model on this process's device, in ``DistributedDataParallel`` or FSDP2.
- :func:`distributed`: the same DataLoader with a ``DistributedSampler`` whose epoch advances by itself and
  whose position can be checkpointed (:class:`DistributedLoader`).
- :func:`seed_everything`, :func:`is_main_process`, :func:`rank_zero_only`, :func:`rank_zero_print`.

The same script runs unchanged as one plain process: without a launcher everything here is a no-op that
returns the model on its device and the loader's order over the whole dataset.
"""

from __future__ import annotations

import builtins
import gc
import inspect
import os
import random
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import wrapt
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from speedups import _env
from speedups.device import default_device
from speedups.errors import SpeedupsError

__all__ = [
    "DistributedLoader",
    "ddp_wrap",
    "destroy_distributed",
    "distributed",
    "init_distributed",
    "is_main_process",
    "rank_zero_only",
    "rank_zero_print",
    "seed_everything",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_TIMEOUT_S = 1800.0
"""Seconds a collective may wait for a peer before the job fails (torch's own default for gloo)."""


# ---------------------------------------------------------------------------------------- process group
def init_distributed(*, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """Initialise the default process group from the environment, once; return whether one is running.

    Reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or SLURM's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, the first host of ``SLURM_JOB_NODELIST`` as the master address,
    ``MASTER_PORT`` or 29500 as the port). Nothing is written to ``os.environ``: the address goes to
    ``init_process_group`` as ``init_method="tcp://host:port"`` with the rank and world size.
    With CUDA the backend is nccl and the current CUDA device is set to ``cuda:LOCAL_RANK`` (never the
    global rank); otherwise gloo. A world size of 1 (no launcher) initialises nothing and returns False;
    an already initialised process group is left as it is and returns True.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or None (nccl with CUDA, gloo otherwise).
        timeout: seconds a collective waits for a peer before failing (default 1800), so a dead peer ends
            the job instead of hanging it. Raise it if rank 0 alone does long work (a huge checkpoint)
            between collectives.

    Returns:
        True when a process group with more than one process is initialised.

    Raises:
        ValueError: ``timeout`` is not a positive number, or ``backend`` is not a string or None.
        SpeedupsError: the environment contradicts itself (``RANK >= WORLD_SIZE``, ...), or ``LOCAL_RANK``
            names a GPU this machine does not have.

    Example:
        >>> init_distributed()  # a plain process: nothing to do
        False
    """
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"init_distributed(timeout={timeout!r}): expected a positive number of seconds.")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"init_distributed(backend={backend!r}): expected 'nccl', 'gloo' or None.")
    dist = torch.distributed
    if not dist.is_available():
        return False
    if dist.is_initialized():
        return int(dist.get_world_size()) > 1
    here = _env.placement(call="init_distributed()")
    if here.world_size == 1:
        return False
    device = default_device()  # validates LOCAL_RANK against the GPUs present, before anything starts
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torchrun (MASTER_ADDR and MASTER_PORT set): env://, which joins torchrun's own store. SLURM alone: the
    # first node of the job, passed explicitly (no env writes).
    init_method = None
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        init_method = f"tcp://{_env.master_addr()}:{_env.master_port()}"
    wait = timedelta(seconds=float(timeout))
    common: dict[str, Any] = {
        "backend": backend,
        "rank": here.rank,
        "world_size": here.world_size,
        "timeout": wait,
    }
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        dist.init_process_group(init_method=init_method, **common)
    else:
        # After an elastic restart (torchrun --max-restarts) torchrun's store still holds the keys of the
        # attempt that crashed (each rank's address): a restarted rank could read a dead peer's address and
        # fail with "connection refused". A prefix per attempt keeps the attempts apart.
        rendezvous = dist.rendezvous(
            init_method or "env://", rank=here.rank, world_size=here.world_size, timeout=wait
        )
        store = dist.PrefixStore(f"speedups/attempt_{attempt}", next(rendezvous)[0])
        dist.init_process_group(store=store, **common)
    return True
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=here.rank, world_size=here.world_size, timeout=wait
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
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()  # free DDP reducers that only reference cycles keep alive
    dist.barrier()
    dist.destroy_process_group()


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
def rank_zero_only(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """Decorate a function so it runs on global rank 0 only and returns None elsewhere.

    For logging, writing files and printing. Never decorate a function that runs a collective (all-reduce,
    barrier, ``LossTracker(all_ranks=True).compute()``): the other ranks would wait for it forever (until
    the process group's timeout). Works on methods; the signature is kept.

    Example:
        >>> @rank_zero_only
        ... def log(msg):
        ...     return f"logged {msg}"
        >>> log("hi")
        'logged hi'
    """
    if _env.rank() != 0:
        return None
    return wrapped(*args, **kwargs)


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
    broadcasts rank 0's weights) and :func:`distributed` loaders agree on the order. Dropout masks are then
    the same on every rank too; add the rank (``seed + rank``) after wrapping if that matters to you.

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
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed_everything(seed={seed!r}): expected an int, e.g. seed_everything(0).")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed_everything(seed={seed!r}): expected 0 <= seed < 2**32 (NumPy's range).")
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


def ddp_wrap(model: nn.Module, *, strategy: str = "ddp", **kwargs: Any) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for data parallelism across the process group.

    Initialises the process group from the environment first if needed (:func:`init_distributed`). The
    device is ``cuda:LOCAL_RANK`` with CUDA (never the global rank), else the CPU. ``strategy="ddp"`` wraps
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
        model: the module to train; at least one parameter must require grad.
        strategy: ``"ddp"`` or ``"fsdp"``.
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
    if isinstance(model, nn.parallel.DistributedDataParallel) or _is_fsdp(model):
        raise TypeError(
            f"ddp_wrap(model={type(model).__name__}): the model is already wrapped. "
            f"Pass the plain module, once."
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
    device = default_device()
    running = init_distributed()
    model.to(device)
    if not running:
        return model
    if strategy == "fsdp":
        return target(model, **kwargs)
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


# ------------------------------------------------------------------------------------------ distributed
class _RankSampler(DistributedSampler):
    """A ``DistributedSampler`` that can leave padding out (``even=False``) and start mid-epoch."""

    def __init__(self, dataset: Any, *, num_replicas: int, rank: int, shuffle: bool, seed: int, even: bool):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.even = even
        self.start = 0  # samples of this epoch to skip (a resumed epoch)
        if not even:
            self.num_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        if self.even:
            indices = list(super().__iter__())
        else:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)  # the same permutation DistributedSampler draws
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            indices = order[self.rank : n : self.num_replicas]
        return iter(indices[self.start :])  # eager: ``start`` is read now, not at the first next()

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


class DistributedLoader(DataLoader):
    """A ``DataLoader`` whose ``DistributedSampler`` advances its epoch by itself and can resume mid-epoch.

    Made by :func:`distributed`; it *is* a ``DataLoader`` (``isinstance``, ``len``, ``iter``, every
    attribute), built from the original's settings. Each ``iter()`` starts the next epoch (0, 1, 2, ...) and
    calls ``sampler.set_epoch`` for you. :attr:`epoch` is the epoch of the current (or last) pass.
    ``set_epoch(k)`` makes the next pass epoch k. :meth:`state_dict` holds the epoch and the number of
    batches already handed out in it, so :func:`~speedups.load_checkpoint` resumes exactly after the last
    batch trained on: neither replayed nor skipped (the skipped batches are never loaded). During a resumed
    pass, ``len()`` is the number of batches that pass yields.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self._resume_batches = 0
        self._current: tuple[int, int] | None = None  # (epoch, batches handed out) of the pass in progress
        self.epoch = -1
        """Epoch of the current or last pass; -1 before the first."""

    @property
    def distributed_sampler(self) -> DistributedSampler:
        """The ``DistributedSampler`` (also when it sits inside the loader's ``batch_sampler``)."""
        sampler = self.sampler if self.batch_sampler is None else self.batch_sampler.sampler  # type: ignore[attr-defined]
        return sampler  # type: ignore[return-value]

    def _batch_size(self) -> int:
        if self.batch_sampler is None:
            return 1
        return int(self.batch_sampler.batch_size)  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its start (each later one then advances by 1)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"DistributedLoader.set_epoch(epoch={epoch!r}): expected an int >= 0.")
        self._next_epoch = epoch
        self._resume_batches = 0
        self.distributed_sampler.start = 0  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.distributed_sampler
        epoch, skip = self._next_epoch, self._resume_batches
        sampler.set_epoch(epoch)
        sampler.start = skip * self._batch_size()  # type: ignore[attr-defined]
        self._next_epoch, self._resume_batches = epoch + 1, 0
        self.epoch = epoch
        self._current = (epoch, skip)
        return _Counting(self, super().__iter__(), epoch, skip)

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"epoch", "batches", "world_size", "rank"}``: where the next batch comes from. No sync."""
        epoch, batches = (
            self._current if self._current is not None else (self._next_epoch, self._resume_batches)
        )
        return {
            "epoch": epoch,
            "batches": batches,
            "world_size": self.distributed_sampler.num_replicas,
            "rank": self.distributed_sampler.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``iter()`` runs epoch ``state["epoch"]`` from batch ``state["batches"]``.

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns, or it is mid-epoch and was saved
                with another world size (its batches would not line up).
        """
        expected = {"epoch", "batches", "world_size", "rank"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"DistributedLoader.load_state_dict(state): expected keys {sorted(expected)}, got {got}. "
                f"Pass what DistributedLoader.state_dict() returned."
            )
        for key in ("epoch", "batches"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"DistributedLoader.load_state_dict(state): state[{key!r}]={value!r}, "
                    f"expected an int >= 0."
                )
        samples, size = self.distributed_sampler.num_samples, self._batch_size()
        drop_last = self.batch_sampler is not None and bool(getattr(self.batch_sampler, "drop_last", False))
        per_epoch = samples // size if drop_last else -(-samples // size)
        if state["batches"] > per_epoch:
            raise ValueError(
                f"DistributedLoader.load_state_dict(state): state['batches']={state['batches']} but an epoch "
                f"of this loader has {per_epoch} batches on this rank. Resume with the same loader settings."
            )
        world = self.distributed_sampler.num_replicas
        if state["batches"] and state["world_size"] != world:
            raise ValueError(
                f"DistributedLoader.load_state_dict(state): saved mid-epoch with world size "
                f"{state['world_size']}, loaded with {world}: the batches would not line up. Resume with the "
                f"same world size, or from a checkpoint taken at an epoch boundary."
            )
        self._next_epoch, self._resume_batches = int(state["epoch"]), int(state["batches"])
        self._current = None
        self.distributed_sampler.start = self._resume_batches * self._batch_size()  # type: ignore[attr-defined]


class _Counting:
    """The DataLoader's iterator, counting batches handed out so the loader knows its position."""

    def __init__(self, loader: DistributedLoader, inner: Iterator[Any], epoch: int, skip: int) -> None:
        self._loader, self._inner, self._epoch, self._done = loader, inner, epoch, skip

    def __iter__(self) -> _Counting:
        return self

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except StopIteration:
            if self._loader._current is not None and self._loader._current[0] == self._epoch:
                self._loader._current = None  # finished: the next pass is the next epoch
            raise
        self._done += 1
        if self._loader._current is not None and self._loader._current[0] == self._epoch:
            self._loader._current = (self._epoch, self._done)
        return batch


_PASSED_THROUGH = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def distributed(
    loader: DataLoader,
    *,
    shuffle: bool | None = None,
    even: bool = True,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> DistributedLoader:
    """Return ``loader`` rebuilt with a ``DistributedSampler``: each rank gets its share of every epoch.

    The new loader keeps the original's batch size, ``drop_last``, workers, ``collate_fn``, ``pin_memory``,
    ``generator`` and every other setting; only the sampler changes (also when it sits inside a
    ``BatchSampler``, which is rebuilt around it). It is a :class:`DistributedLoader` (a ``DataLoader``):
    each new ``iter()`` advances the epoch, so the order changes every epoch, the same on all ranks, and no
    ``set_epoch`` call can be forgotten; ``set_epoch(k)`` or ``load_state_dict`` resume epoch k exactly (mid
    epoch too). The original loader is not modified.

    ``even=True`` (training) pads as ``DistributedSampler`` does, repeating the first few samples so every
    rank gets the same number of batches (collectives such as DDP's all-reduce need that). ``even=False``
    (evaluation) gives each sample to exactly one rank with no padding, so a metric does not depend on the
    world size; ranks may then get different numbers of batches (differing by at most one), so inside such
    a loop run no collective that assumes equal counts (no DDP forward/backward, no per-batch all-reduce):
    accumulate locally and reduce once after the loop (e.g. ``LossTracker(all_ranks=True)``).

    Sync points: none (each rank computes the same permutation from ``seed + epoch``). In a plain process
    (world size 1) the order is the whole dataset, still advancing per epoch.

    Args:
        loader: a map-style ``DataLoader`` whose sampler is a ``RandomSampler`` (shuffled),
            a ``SequentialSampler`` (not shuffled), or either inside a ``BatchSampler``.
        shuffle: shuffle every epoch; None keeps what the original did.
        even: pad so every rank gets equal batch counts (True, training), or give every sample exactly once
            (False, evaluation).
        seed: the shuffling seed; must be the same on all ranks.
        rank: this process's global rank; None reads it from the process group or ``RANK``/``SLURM_PROCID``
            (the global rank, never the local one).
        world_size: the number of ranks; None reads it like ``rank``.

    Returns:
        A :class:`DistributedLoader`.

    Raises:
        TypeError: ``loader`` is not a DataLoader, or holds an ``IterableDataset``, or a sampler that cannot
            be split across ranks (weighted, subset, custom).
        ValueError: ``rank``/``world_size``/``seed`` out of range, or ``loader`` is already distributed.
        SpeedupsError: the environment contradicts itself.

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
        >>> ranks = [distributed(loader, rank=r, world_size=2) for r in (0, 1)]
        >>> [len(r) for r in ranks]                    # 5 samples each: batches of 2, 2, 1
        [3, 3]
        >>> epoch0 = [sorted(x for b in r for x in b.tolist()) for r in ranks]
        >>> sorted(epoch0[0] + epoch0[1]) == list(range(10))   # disjoint, covering everything
        True
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"distributed(loader={type(loader).__name__}): expected a torch.utils.data.DataLoader. "
            f"Build one first: distributed(DataLoader(dataset, batch_size=..., shuffle=True))."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            f"distributed(loader=DataLoader({type(loader.dataset).__name__})): an IterableDataset has no "
            f"indices a DistributedSampler could split, so every rank would read the same stream. Split the "
            f"stream inside the dataset's __iter__ by rank (torch.distributed.get_rank(), get_world_size(), "
            f"and torch.utils.data.get_worker_info() for workers), or use a map-style Dataset "
            f"(__getitem__ and __len__)."
        )
    if isinstance(loader, DistributedLoader):
        raise ValueError(f"distributed(loader={type(loader).__name__}): this loader is already distributed.")
    for name, value in (("shuffle", shuffle), ("even", even)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"distributed({name}={value!r}): expected True or False.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"distributed(seed={seed!r}): expected an int, the same on every rank.")
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise TypeError(
            f"distributed(loader): its batch_sampler is a {type(batch_sampler).__name__}, which cannot be "
            f"rebuilt around a DistributedSampler. Give the DataLoader a batch_size and a RandomSampler or "
            f"SequentialSampler instead, or split indices by rank inside your batch sampler."
        )
    inner = loader.sampler if batch_sampler is None else batch_sampler.sampler
    if isinstance(inner, DistributedSampler):
        raise ValueError(
            f"distributed(loader): its sampler is already a {type(inner).__name__}. Pass the loader built "
            f"with shuffle=True/False, and distributed() adds the DistributedSampler."
        )
    if type(inner) is RandomSampler:
        if inner.replacement or inner._num_samples is not None:
            raise TypeError(
                "distributed(loader): its RandomSampler draws with replacement or a num_samples, which a "
                "DistributedSampler cannot reproduce. Use shuffle=True without those."
            )
        was_shuffled = True
    elif type(inner) is SequentialSampler:
        was_shuffled = False
    else:
        raise TypeError(
            f"distributed(loader): its sampler is a {type(inner).__name__}; only a RandomSampler "
            f"(shuffle=True) or SequentialSampler (shuffle=False) can be split across ranks. For weighted or "
            f"subset sampling, split the indices by rank yourself."
        )
    here = _env.placement(call="distributed()")
    num_replicas = here.world_size if world_size is None else world_size
    this_rank = here.rank if rank is None else rank
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"distributed(world_size={world_size!r}): expected an int >= 1.")
    if isinstance(this_rank, bool) or not isinstance(this_rank, int) or not 0 <= this_rank < num_replicas:
        raise ValueError(
            f"distributed(rank={rank!r}, world_size={world_size!r}): expected 0 <= rank < world_size "
            f"({num_replicas})."
        )
    sampler = _RankSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=this_rank,
        shuffle=was_shuffled if shuffle is None else shuffle,
        seed=seed,
        even=even,
    )
    params = inspect.signature(DataLoader.__init__).parameters
    kwargs = {
        name: getattr(loader, name) for name in _PASSED_THROUGH if name in params and hasattr(loader, name)
    }
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    if loader.batch_size is not None:  # built from batch_size: keep batch_size and drop_last as attributes
        kwargs.update(sampler=sampler, batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif batch_sampler is not None:  # the user's own BatchSampler: rebuild it around the new sampler
        kwargs["batch_sampler"] = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    else:
        kwargs.update(sampler=sampler, batch_size=None)
    return DistributedLoader(loader.dataset, **kwargs)

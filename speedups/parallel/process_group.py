"""Tip 9, the process group: made from torchrun's or SLURM's variables with a timeout, and ended cleanly.

The step from one process to many is where hand-written loops break quietly: the global rank is used as a
GPU index on the second node, a dead peer hangs the job. :func:`init_distributed` joins with a rendezvous
that says who is missing (:mod:`speedups.parallel.rendezvous`) and :func:`destroy_distributed` ends the
group without the abort a live DDP reducer causes. Without a launcher both are no-ops, so the same script
runs unchanged as one plain process.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from datetime import timedelta

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups.device import default_device
from speedups.parallel import rendezvous

__all__ = ["DEFAULT_TIMEOUT_S", "destroy_distributed", "init_distributed", "start_process_group"]

DEFAULT_TIMEOUT_S = 1800.0
"""Seconds a collective may wait for a peer before the job fails (torch's own default for gloo)."""


# ---------------------------------------------------------------------------------------- process group
def init_distributed(
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    rendezvous_timeout: float = rendezvous.DEFAULT_RENDEZVOUS_TIMEOUT_S,
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
    with validate.arguments(said):
        validate.real(timeout, "timeout", positive=True, example="1800 (seconds)")
        validate.real(rendezvous_timeout, "rendezvous_timeout", positive=True, example="300 (seconds)")
        validate.instance(backend, str, "backend", what="'nccl', 'gloo'", none_ok=True)
    return start_process_group(
        backend=backend, timeout=timeout, rendezvous_timeout=rendezvous_timeout, device=None
    )


def start_process_group(
    *, backend: str | None, timeout: float, rendezvous_timeout: float, device: torch.device | None
) -> bool:
    """:func:`init_distributed` with checked arguments, and ``device`` (None: :func:`default_device`)."""
    dist = torch.distributed
    if env.pg_ready():
        return int(dist.get_world_size()) > 1
    if not dist.is_available():
        return False
    here = env.placement(call="init_distributed()")
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
        url = f"tcp://{env.master_addr()}:{env.master_port()}"
    shown = {
        "MASTER_ADDR": os.environ.get("MASTER_ADDR") or f"(unset, used {env.master_addr()})",
        "MASTER_PORT": os.environ.get("MASTER_PORT") or f"(unset, used {env.master_port()})",
        "WORLD_SIZE": str(here.world_size),
        "RANK": str(here.rank),
    }
    # After an elastic restart (torchrun --max-restarts) the store may still hold the keys of the attempt
    # that crashed (each rank's address): a prefix per attempt keeps the attempts apart.
    prefix = f"speedups/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = rendezvous.join(
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
    _end_at_exit()
    return True


_exit_hook: list[bool] = []


def _end_at_exit() -> None:
    """Register, once per process, :func:`_release_group` to run at interpreter exit."""
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(_release_group)


def _release_group() -> None:
    """At exit (after the script, before Python finalises): end a process group the run left open.

    gloo's worker threads free each collective's work object after it completed, and need the GIL for the
    tensors it holds; one still doing so when Python starts finalising is ended by a forced unwind through a
    C++ destructor, which aborts the process: "terminate called without an active exception", a non-zero
    exit (about 1 exit in 4 with 2 gloo processes on torch 2.14, in plain PyTorch too, with or without
    ``destroy_process_group()`` at the script's end). Collecting garbage first gives those threads that
    moment and frees unreachable DDP reducers; destroying the group then joins its threads while Python still
    runs. No collective: a rank whose peers died or hang exits at once. Errors are not raised at exit.
    """
    if not env.pg_ready():
        return
    with contextlib.suppress(Exception):
        gc.collect()
        torch.distributed.destroy_process_group()


def destroy_distributed() -> None:
    """End the job's process group cleanly: collect garbage, wait for every rank, destroy the group.

    Call it once per process at the very end, after the function that held the DDP model has returned
    (the pattern of ``examples/train_ddp.py``: ``accuracy = train(args); destroy_distributed()``). A group
    :func:`init_distributed` started and the script left open is ended at interpreter exit anyway (see
    ``_release_group``): gloo's threads still freeing the last collective's work when Python finalises abort
    the process ("terminate called without an active exception"). Here the garbage collection frees
    unreachable DDP reducers while the group still exists, and the barrier keeps a fast rank from tearing
    down its connections while a slow one still talks to it. No-op without a process group.

    A checkpoint still being written in the background (``save_checkpoint(..., background=True)``; for
    FSDP2, DCP's thread uses the group) is waited for first.

    Sync points: one barrier (a collective: every rank must call it).
    """
    if not env.pg_ready():
        return
    from speedups.checkpoint import background  # here: the checkpoint package builds on this one

    background.wait()
    gc.collect()  # free DDP reducers that only reference cycles keep alive
    arrive("destroy_distributed")
    with env.on_comm_device():  # NCCL's barrier runs on the current device: make it this rank's
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()

"""Which process am I, and which device is mine: one written rule for every launch style.

One small place answers this for every tip (``to_device``, ``LossTracker``'s cross-rank read,
``distributed()``, ``ddp_wrap``, ``launch``). Nothing here writes to the environment or initialises anything.

The launch style (:func:`launch_style`) is a :class:`~speedups._helpers.environments.LaunchEnvironment`, one
class per style, tried in order (first match wins; see :mod:`speedups._helpers.environments.registry`):

============== ============================================================ ==============================
style          recognised by                                                 rank / world size from
============== ============================================================ ==============================
``torchrun``   ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set (torchrun,          those variables
               :func:`~speedups.launch`, torch.distributed.elastic)
``srun``       ``SLURM_PROCID`` and ``SLURM_STEP_ID`` (only srun sets it)     ``SLURM_PROCID``,
                                                                             ``SLURM_STEP_NUM_TASKS``
``process``    a process group initialised by the user (``mp.spawn``)       the process group
``allocation`` SLURM variables of more than one task but no srun              one process (with one warning)
               (``python train.py`` in an ``salloc``/``sbatch`` shell)
``single``     none of these                                                 rank 0 of 1
============== ============================================================ ==============================

An initialised process group is always the truth for the global rank and world size.

The device rule (:func:`cuda_index`), with CUDA: ``torchrun`` -> ``cuda:LOCAL_RANK`` (an error if that
GPU is not visible); ``srun`` -> ``cuda:(SLURM_LOCALID % visible GPUs)``: with one GPU bound per task
(``--gpus-per-task=1``) every task's GPU is ``cuda:0``, with all of a node's GPUs visible it is
``cuda:SLURM_LOCALID``, and indices are always within ``CUDA_VISIBLE_DEVICES``; ``process`` -> the current
CUDA device (what ``torch.cuda.set_device(rank)`` chose); otherwise the current device if CUDA is
initialised, else ``cuda:0``. An explicit ``ddp_wrap(model, device=...)`` overrides all of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from speedups._helpers.environments import detect
from speedups._helpers.environments.base import pg_ready, read_int
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = [
    "Placement",
    "comm_device",
    "cuda_index",
    "device",
    "first_host",
    "is_distributed",
    "launch_style",
    "local_rank",
    "local_world_size",
    "master_addr",
    "master_port",
    "on_comm_device",
    "pg_ready",
    "placement",
    "rank",
    "world_size",
]


def launch_style(env: Mapping[str, str] | None = None) -> str:
    """Return how this process was started: ``torchrun``, ``srun``, ``process``, ``allocation``, ``single``.

    ``env`` given: only that mapping is read (the process group is not consulted).
    """
    return detect(env).name


def rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's global rank (0 in a single-process run)."""
    if env is None and pg_ready():
        return int(torch.distributed.get_rank())
    return detect(env).values()[0]


def world_size(env: Mapping[str, str] | None = None) -> int:
    """Return the number of processes in the job (1 in a single-process run)."""
    if env is None and pg_ready():
        return int(torch.distributed.get_world_size())
    return detect(env).values()[2]


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's rank on its node (0 without a launcher): never the global rank."""
    return detect(env).values()[1]


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Return the number of processes on this node (1 in a single-process run)."""
    return detect(env).values()[3]


def is_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Return True when the job has more than one process."""
    return world_size(env) > 1


def cuda_index(env: Mapping[str, str] | None = None, *, count: int | None = None) -> int:
    """Return the index of this process's CUDA device by the rule in this module's docstring.

    Args:
        env: the environment to read (default ``os.environ``, and the process group).
        count: the number of visible CUDA devices (default ``torch.cuda.device_count()``).

    Raises:
        SpeedupsError: under torchrun, ``LOCAL_RANK`` names a GPU this process cannot see.
    """
    environment = detect(env)
    environment.values()  # a malformed launcher variable is an error here too, not a silent 0
    return environment.cuda_index(torch.cuda.device_count() if count is None else count)


def device(env: Mapping[str, str] | None = None) -> torch.device:
    """This process's device: CUDA by :func:`cuda_index`, else ``mps``, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", cuda_index(env))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def comm_device() -> torch.device:
    """The device this rank's collectives run on: its own GPU (:func:`device`) under NCCL, else the CPU.

    Not ``torch.cuda.current_device()``: a process group made by the user, without
    ``torch.cuda.set_device``, leaves every rank's current device at ``cuda:0`` (NCCL then sees duplicate
    GPUs, or hangs).
    """
    if pg_ready() and torch.distributed.get_backend() == "nccl":
        return device()
    return torch.device("cpu")


@contextlib.contextmanager
def on_comm_device() -> Iterator[torch.device]:
    """Run a block of collectives with :func:`comm_device` as the current CUDA device, and yield it.

    torch's object collectives (``all_gather_object``, ``broadcast_object_list``) and NCCL's ``barrier``
    use the current device; inside this block it is this rank's own GPU whatever the user set.
    """
    place = comm_device()
    if place.type != "cuda":
        yield place
        return
    with torch.cuda.device(place):
        yield place


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, read once and checked for contradictions."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def placement(env: Mapping[str, str] | None = None, *, call: str = "speedups") -> Placement:
    """Read rank, local rank, world size and local world size, and reject contradictory values.

    SLURM variables of several tasks without srun (``allocation``) give a single process and one
    ``SpeedupsWarning`` per process that says how to start the tasks.

    Raises:
        SpeedupsError: a negative value, ``RANK >= WORLD_SIZE``, ``LOCAL_RANK >= LOCAL_WORLD_SIZE``,
            ``LOCAL_WORLD_SIZE > WORLD_SIZE``, or a rank variable without the matching world size (torchrun's
            ``RANK`` and ``WORLD_SIZE`` always come together: one alone is a leftover in the shell).
    """
    environment = detect(env)
    notice = environment.notice()
    if notice is not None:
        # stacklevel=1 and the same text from every call: Python's default filter shows it once per process.
        warnings.warn(notice, SpeedupsWarning, stacklevel=1)
    here = Placement(rank(env), local_rank(env), world_size(env), local_world_size(env))
    shown = (
        f"RANK={here.rank}, LOCAL_RANK={here.local_rank}, WORLD_SIZE={here.world_size}, "
        f"LOCAL_WORLD_SIZE={here.local_world_size}"
    )
    problem = None
    missing = [] if env is None and pg_ready() else environment.missing()
    if missing:
        problem = f"{' and '.join(missing)} not set, though a launcher sets them all: left over in the shell?"
    elif min(here.rank, here.local_rank) < 0 or min(here.world_size, here.local_world_size) < 1:
        problem = "ranks must be >= 0 and world sizes >= 1"
    elif here.rank >= here.world_size:
        problem = "the global rank must be below the world size"
    elif here.local_rank >= here.local_world_size and environment.states_local_world_size():
        problem = "the local rank must be below the local world size"
    elif here.local_world_size > here.world_size:
        problem = "a node cannot hold more processes than the whole job"
    if problem is not None:
        raise SpeedupsError(
            f"{call}: contradictory environment ({shown}): {problem}. "
            f"Launch with `torchrun --nnodes N --nproc-per-node K script.py` (or `srun`), which sets them "
            f"all consistently, or unset them for a single-process run."
        )
    return here


def master_port(env: Mapping[str, str] | None = None) -> int:
    """Return ``MASTER_PORT``, else 29500 (torchrun's default)."""
    return read_int(os.environ if env is None else env, ("MASTER_PORT",), 29500)


def master_addr(env: Mapping[str, str] | None = None) -> str:
    """Return the rendezvous host: ``MASTER_ADDR``, else the first host of SLURM's node list, else 127.0.0.1.

    The SLURM node list (``SLURM_JOB_NODELIST`` or ``SLURM_NODELIST``, e.g. ``"gpu[03-05,09],cpu1"``) is
    expanded by ``scontrol show hostnames`` when ``scontrol`` is on the PATH, else parsed here.
    """
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
            hosts = out.stdout.split()
            if out.returncode == 0 and hosts:
                return hosts[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return first_host(nodelist)


def first_host(nodelist: str) -> str:
    """Return the first host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            end = i
            break
    head = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], head)

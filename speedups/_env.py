"""Which process am I, and which device is mine: read from torchrun, SLURM and the process group.

One small place answers this for every tip (``to_device``, ``LossTracker``'s cross-rank read,
``distributed()``, ``ddp_wrap``). Nothing here writes to the environment or initialises anything.

Precedence: an initialised ``torch.distributed`` process group is the truth for the global rank and the
world size; otherwise torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``);
otherwise SLURM's (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``);
otherwise a single process (rank 0 of 1).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "Placement",
    "pg_ready",
    "is_distributed",
    "local_rank",
    "local_world_size",
    "master_addr",
    "master_port",
    "placement",
    "rank",
    "world_size",
]

# (torchrun name, SLURM name) for each quantity.
_RANK = ("RANK", "SLURM_PROCID")
_LOCAL_RANK = ("LOCAL_RANK", "SLURM_LOCALID")
_WORLD_SIZE = ("WORLD_SIZE", "SLURM_NTASKS")
_LOCAL_WORLD_SIZE = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def _read_int(names: tuple[str, str], default: int, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        # SLURM_NTASKS_PER_NODE may read "4(x2)"; the leading number is this node's count.
        head = raw.split("(")[0].split(",")[0]
        try:
            return int(head)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} is not an integer. "
                f"Set it to a whole number, or unset it for a single-process run."
            ) from None
    return default


def pg_ready() -> bool:
    """True when torch.distributed is built in and a default process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's global rank (0 in a single-process run)."""
    if env is None and pg_ready():
        return int(torch.distributed.get_rank())
    return _read_int(_RANK, 0, env)


def world_size(env: Mapping[str, str] | None = None) -> int:
    """Return the number of processes in the job (1 in a single-process run)."""
    if env is None and pg_ready():
        return int(torch.distributed.get_world_size())
    return _read_int(_WORLD_SIZE, 1, env)


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's rank on its node: the index of its accelerator, never the global rank."""
    return _read_int(_LOCAL_RANK, 0, env)


def local_world_size(env: Mapping[str, str] | None = None) -> int:
    """Return the number of processes on this node (1 in a single-process run)."""
    return _read_int(_LOCAL_WORLD_SIZE, 1, env)


def is_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Return True when the job has more than one process."""
    return world_size(env) > 1


@dataclass(frozen=True)
class Placement:
    """Where this process sits in the job, read once and checked for contradictions."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def placement(env: Mapping[str, str] | None = None, *, call: str = "speedups") -> Placement:
    """Read rank, local rank, world size and local world size, and reject contradictory values.

    Raises:
        SpeedupsError: a negative value, ``RANK >= WORLD_SIZE``, ``LOCAL_RANK >= LOCAL_WORLD_SIZE``,
            ``LOCAL_WORLD_SIZE > WORLD_SIZE``, or a rank variable without the matching world size.
    """
    from speedups.errors import SpeedupsError

    env_map = os.environ if env is None else env
    here = Placement(rank(env), local_rank(env), world_size(env), local_world_size(env))
    shown = (
        f"RANK={here.rank}, LOCAL_RANK={here.local_rank}, WORLD_SIZE={here.world_size}, "
        f"LOCAL_WORLD_SIZE={here.local_world_size}"
    )
    problem = None
    if min(here.rank, here.local_rank) < 0 or min(here.world_size, here.local_world_size) < 1:
        problem = "ranks must be >= 0 and world sizes >= 1"
    elif here.rank >= here.world_size:
        problem = "the global rank must be below the world size"
    elif here.local_rank >= here.local_world_size and _set(env_map, _LOCAL_WORLD_SIZE):
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


def _set(env: Mapping[str, str], names: tuple[str, str]) -> bool:
    return any(env.get(name) for name in names)


def master_port(env: Mapping[str, str] | None = None) -> int:
    """Return ``MASTER_PORT``, else 29500 (torchrun's default)."""
    return _read_int(("MASTER_PORT", "MASTER_PORT"), 29500, env)


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

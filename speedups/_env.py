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
from collections.abc import Mapping

import torch

__all__ = ["rank", "local_rank", "world_size", "local_world_size", "is_distributed"]

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


def _pg_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank(env: Mapping[str, str] | None = None) -> int:
    """Return this process's global rank (0 in a single-process run)."""
    if env is None and _pg_ready():
        return int(torch.distributed.get_rank())
    return _read_int(_RANK, 0, env)


def world_size(env: Mapping[str, str] | None = None) -> int:
    """Return the number of processes in the job (1 in a single-process run)."""
    if env is None and _pg_ready():
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

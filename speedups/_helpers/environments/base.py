"""The interface every launch style implements, and the environment reading they share.

A launch style (torchrun, SLURM's srun, ...) is a small :class:`LaunchEnvironment` subclass in a file of its
own, as Lightning keeps one ``ClusterEnvironment`` per cluster; :mod:`.registry` lists them in the order
they are tried. Nothing here writes to the environment or initialises anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

__all__ = ["LaunchEnvironment", "pg_ready", "read_int"]


def pg_ready() -> bool:
    """True when torch.distributed is built in and a default process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _int(name: str, raw: str) -> int:
    # SLURM_NTASKS_PER_NODE may read "4(x2)"; the leading number is this node's count.
    head = raw.split("(")[0].split(",")[0]
    try:
        return int(head)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer. "
            f"Set it to a whole number, or unset it for a single-process run."
        ) from None


def read_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    """The first of the variables ``names`` that is set and not empty, as an int; ``default`` if none is.

    Raises:
        ValueError: the variable is not a whole number (its name and value in the message).
    """
    for name in names:
        raw = env.get(name)
        if raw:
            return _int(name, raw)
    return default


class LaunchEnvironment:
    """How a process started by one launch style learns its place in the job and its CUDA device.

    The base class is a plain single process: rank 0 of 1, ``cuda:0`` (or the current device once CUDA is
    initialised). A subclass overrides :meth:`detect` and what its launcher tells differently.

    Attributes:
        name: the style's short name (``"torchrun"``, ``"srun"``, ...), as error messages and tests say it.
        launched: whether a launcher already started the job's processes (then ``launch()`` starts none).
        env: the environment variables read (``os.environ`` unless a mapping was given).
    """

    name: ClassVar[str] = "single"
    launched: ClassVar[bool] = False

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        """Whether this process was started this way; ``live``: ``env`` is ``os.environ`` and the process
        group may be consulted too."""
        raise NotImplementedError

    def rank(self) -> int:
        """The global rank this launcher gave (the process group, once initialised, is the truth)."""
        return 0

    def local_rank(self) -> int:
        """The rank on this node."""
        return 0

    def world_size(self) -> int:
        """The number of processes in the job."""
        return 1

    def local_world_size(self) -> int:
        """The number of processes on this node."""
        return 1

    def values(self) -> tuple[int, int, int, int]:
        """Rank, local rank, world size and local world size, all read (a malformed one raises).

        Raises:
            ValueError: a launcher variable is not a whole number (its name and value in the message).
        """
        return self.rank(), self.local_rank(), self.world_size(), self.local_world_size()

    def missing(self) -> list[str]:
        """The variables this launcher always sets that are missing (a leftover of a job in the shell)."""
        return []

    def states_local_world_size(self) -> bool:
        """Whether the launcher set the local world size (only then can it contradict the local rank)."""
        return False

    def cuda_index(self, count: int) -> int:
        """The index of this process's CUDA device among ``count`` visible ones.

        Raises:
            SpeedupsError: the launcher names a GPU this process cannot see.
        """
        return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else 0

    def notice(self) -> str | None:
        """A warning to give once per process about how it was started (None: nothing to say)."""
        return None

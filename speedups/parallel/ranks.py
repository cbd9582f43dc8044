"""Which process this is (rank, local rank, world size), and functions and prints that run on rank 0 only."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import wrapt

from speedups._helpers import env

__all__ = ["is_main_process", "local_rank", "rank", "rank_zero_only", "rank_zero_print", "world_size"]


def rank() -> int:
    """Return this process's global rank: 0 to ``world_size() - 1``, 0 in a plain run.

    Read from the process group once ``init_distributed()`` (or ``ddp_wrap``) made it, else from the
    launcher's variables (``RANK``, ``SLURM_PROCID``). The same for every launch style.

    Raises:
        ValueError: a launcher variable is not a whole number.
        SpeedupsError: the launcher variables contradict each other (``RANK=1`` with no ``WORLD_SIZE``,
            a leftover in the shell), named in the message.

    Example:
        >>> rank(), local_rank(), world_size()
        (0, 0, 1)
    """
    return env.placement(call="rank()").rank


def local_rank() -> int:
    """Return this process's rank on its node (``LOCAL_RANK``, ``SLURM_LOCALID``), 0 in a plain run.

    The index of this process's GPU under torchrun, never the global rank (see ``default_device``).

    Raises:
        ValueError: a launcher variable is not a whole number.
    """
    return env.placement(call="local_rank()").local_rank


def world_size() -> int:
    """Return the number of processes in the job, 1 in a plain run (the process group's, once made).

    Raises:
        ValueError: a launcher variable is not a whole number.
        SpeedupsError: the launcher variables contradict each other (see ``rank``).
    """
    return env.placement(call="world_size()").world_size


def is_main_process() -> bool:
    """Return True on global rank 0 (the process that logs and writes checkpoints), and in a plain run.

    Reads the process group if one is initialised, else ``RANK``/``SLURM_PROCID``. Never the local rank:
    on a second node, local rank 0 is not the main process.

    Example:
        >>> is_main_process()
        True
    """
    return env.placement(call="is_main_process()").rank == 0


@wrapt.decorator
def _rank_zero(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    if env.placement(call="rank_zero_only").rank != 0:
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
    if env.placement(call="rank_zero_print()").rank == 0:
        builtins.print(*args, **kwargs)

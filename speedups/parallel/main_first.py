"""``main_process_first()``: rank 0 runs a block before the other ranks do (a dataset cache, a download)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups.errors import SpeedupsError
from speedups.parallel.process_group import init_distributed

__all__ = ["main_process_first"]


@contextlib.contextmanager
def main_process_first(*, local: bool = False) -> Iterator[None]:
    """Run the block on the main process first, then on the others (Accelerate's ``main_process_first``).

    The classic use: rank 0 builds a dataset cache (tokenisation, ``datasets.map``) or downloads a file, the
    others then read what it wrote instead of building it again at the same time. With ``local=True`` the
    first process of each node (local rank 0) goes first: one download per node's disk. In a plain process
    the block just runs. Initialises the process group from the launcher's variables if needed.

    Sync points: one small all-gather per rank (before the block on the others, after it on the first; the
    first leave as the others enter). Every rank must enter it; one that never does is named after 10 s
    and fails at the collective timeout. If the block raises on a first rank, the others raise a
    ``SpeedupsError`` instead of running it on what the failed rank left behind.

    Args:
        local: the first process of each node goes first (True), or global rank 0 (False).

    Raises:
        TypeError: ``local`` is not a bool.
        SpeedupsError: some rank never entered it (at the collective timeout), or the block failed on a
            rank that went first.

    Example:
        >>> with main_process_first():
        ...     cache = "built once"   # rank 0 first, then the others read it
    """
    with validate.arguments(f"main_process_first(local={local!r})"):
        validate.flag(local, "local")
    if env.world_size() > 1 and not env.pg_ready():
        init_distributed()
    if not env.pg_ready() or env.world_size() == 1:
        yield
        return
    first = (env.local_rank() if local else env.rank()) == 0
    if not first:
        failed = _meet(False)
        if any(failed):
            raise SpeedupsError(
                f"main_process_first(local={local}): the block failed on rank(s) "
                f"{[r for r, f in enumerate(failed) if f]} (their error is in their own output), so this "
                f"rank does not run it on what they left behind."
            )
        yield
        return
    try:
        yield
    except BaseException:
        _meet(True)  # the others learn it and raise instead of running on a half-built cache
        raise
    _meet(False)


def _meet(failed: bool) -> list[bool]:
    """Every rank's flag (did the block fail there?): the one collective that orders the ranks."""
    arrive("main_process_first")
    flags: list[object] = [None] * env.world_size()
    with env.on_comm_device():  # this rank's GPU under NCCL, not whatever is current
        torch.distributed.all_gather_object(flags, failed)
    return [bool(f) for f in flags]

"""``main_process_first()``: rank 0 runs a block before the other ranks do (a dataset cache, a download)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups.parallel.process_group import init_distributed

__all__ = ["main_process_first"]


@contextlib.contextmanager
def main_process_first(*, local: bool = False) -> Iterator[None]:
    """Run the block on the main process first, then on the others (Accelerate's ``main_process_first``).

    The classic use: rank 0 builds a dataset cache (tokenisation, ``datasets.map``) or downloads a file, the
    others then read what it wrote instead of building it again at the same time. With ``local=True`` the
    first process of each node (local rank 0) goes first: one download per node's disk. In a plain process
    the block just runs. Initialises the process group from the launcher's variables if needed.

    Sync points: two barriers' worth of waiting (one barrier per rank: before the block on the others,
    after it on the first). Every rank must enter it; one that never does is named after 10 s and fails at
    the collective timeout.

    Args:
        local: the first process of each node goes first (True), or global rank 0 (False).

    Raises:
        TypeError: ``local`` is not a bool.
        SpeedupsError: some rank never entered it (at the collective timeout).

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
        _wait_for_the_first()
    try:
        yield
    finally:
        if first:
            _wait_for_the_first()


def _wait_for_the_first() -> None:
    arrive("main_process_first")
    torch.distributed.barrier()

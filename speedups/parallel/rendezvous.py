"""The rendezvous of :func:`~speedups.init_distributed`: short, counted, and loud when it cannot complete.

``init_process_group(timeout=...)`` uses one timeout for two very different waits: peers joining (seconds,
or never: a stale ``WORLD_SIZE``, a missing ``srun``) and a collective waiting for a slow rank (minutes).
Here the join has its own short timeout: every rank connects to the store at ``MASTER_ADDR:MASTER_PORT``
and adds itself to a counter; after a few seconds without everyone, each waiting rank says so on stderr;
past the rendezvous timeout it raises an error naming the variables read and how many peers joined. The
store then gets the long collective timeout and is handed to ``init_process_group``.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from speedups.errors import SpeedupsError

__all__ = ["DEFAULT_RENDEZVOUS_TIMEOUT_S", "NOTICE_AFTER_S", "join"]

DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
"""Seconds every process of the job may take to join before :func:`join` fails (5 minutes)."""

NOTICE_AFTER_S = 10.0
"""Seconds of waiting after which each waiting rank prints one line on stderr saying what it waits for."""

_rounds = itertools.count()  # one counter key per init in this process (the same sequence on every rank)


def join(
    url: str,
    *,
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    shown: Mapping[str, str],
    call: str,
) -> Any:
    """Connect to the store at ``url``, wait until all ``world_size`` ranks joined, return the store.

    Args:
        url: ``"env://"`` (torchrun: its own store) or ``"tcp://host:port"``.
        prefix: the key prefix of this attempt (one per elastic restart).
        rank: this process's global rank.
        world_size: the number of processes expected.
        timeout_s: seconds to wait for all of them (the rendezvous timeout).
        shown: the variables read, as the user would set them (quoted in the error).
        call: the public call, quoted in messages.

    Raises:
        SpeedupsError: the store could not be reached, or not every rank joined within ``timeout_s``.
    """
    dist = torch.distributed
    where = ", ".join(f"{k}={v}" for k, v in shown.items())
    done = threading.Event()
    joined = [0]

    def notice() -> None:
        if not done.wait(min(NOTICE_AFTER_S, timeout_s / 2)):
            have = f"{joined[0]} of {world_size} processes joined so far" if joined[0] else "none joined yet"
            print(
                f"speedups {call}: rank {rank} is waiting for the other processes of the job at {url} "
                f"({where}); {have}. Failing after {timeout_s:g} s (rendezvous_timeout). "
                f"A WORLD_SIZE left in the environment, or `python` instead of `srun`/`torchrun`, causes "
                f"this.",
                file=sys.stderr,
                flush=True,
            )

    watcher = threading.Thread(target=notice, name="speedups-rendezvous-notice", daemon=True)
    watcher.start()
    deadline = time.monotonic() + timeout_s
    try:
        try:
            store = next(
                dist.rendezvous(url, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
            )[0]
        except (RuntimeError, ValueError) as err:  # DistStoreError, DistNetworkError are RuntimeErrors
            count = re.search(r"(\d+)/(\d+) clients joined", str(err))
            peers = (
                f"{count.group(1)} of {world_size} processes joined"
                if count
                else f"rank {rank} could not reach the store, so it knows of no peer "
                f"(0 of {world_size} joined)"
            )
            raise SpeedupsError(_failed(call, url, where, timeout_s, peers, err)) from err
        key = f"{prefix}/joined/{next(_rounds)}"
        joined[0] = int(store.add(key, 1))
        while joined[0] < world_size:
            if time.monotonic() > deadline:
                raise SpeedupsError(
                    _failed(
                        call, url, where, timeout_s, f"{joined[0]} of {world_size} processes joined", None
                    )
                )
            time.sleep(0.02)
            joined[0] = int(store.add(key, 0))
        return store
    finally:
        done.set()


def _failed(call: str, url: str, where: str, timeout_s: float, peers: str, err: BaseException | None) -> str:
    cause = f" ({type(err).__name__}: {str(err).splitlines()[0][:200]})" if err is not None else ""
    return (
        f"{call}: the rendezvous at {url} did not complete within {timeout_s:g} s: {peers}{cause}. "
        f"Read from the environment: {where}. Either the other processes were never started "
        f"(a stale WORLD_SIZE/RANK in the shell: `unset WORLD_SIZE RANK LOCAL_RANK`; `python` instead of "
        f"`srun`/`torchrun`), they crashed, or MASTER_ADDR:MASTER_PORT is not reachable from here. Start "
        f"every "
        f"process with torchrun, srun or speedups.launch(fn, nprocs=N), or raise "
        f"init_distributed(rendezvous_timeout=...) if some start late."
    )

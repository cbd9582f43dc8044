"""No collective of ``speedups`` waits silently for a rank that never makes the same call.

A collective called on some ranks only (``save_checkpoint`` under ``if is_main_process():``, as a ported
nanoGPT script does) would block until the process group's timeout, or forever where the other ranks' next
collective happens to match it. Before such a call every rank checks in at the process group's key-value
store under the call's name and a per-call sequence number; the ones that arrive wait for the others there,
outside any collective. After :data:`NOTICE_AFTER_S` seconds the waiting rank says on stderr which call
every rank must make; at the collective timeout it raises. A slow peer that does arrive is waited for.
Costs a few store round trips per call (calls that are themselves collectives, never on the hot path).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from datetime import timedelta

from speedups._helpers import compat, env
from speedups.errors import SpeedupsError

__all__ = ["NOTICE_AFTER_S", "arrive"]

NOTICE_AFTER_S = 10.0
"""Seconds a rank waits for the others before it says which call they must make."""

_calls: defaultdict[str, int] = defaultdict(int)  # per call name: how many times this process made it


def arrive(
    call: str, *, timeout_s: float | None = None, alone_after_s: float | None = None, token: str | None = None
) -> bool:
    """Wait until every rank has called ``call`` (its n-th time here, the n-th time there too); no collective.

    With ``alone_after_s``, rank 0 stops waiting after that many seconds and goes on alone; a rank that
    arrives later learns so and goes on alone too. The decision is made once, atomically, in the store
    (``compare_set``), so every rank agrees on it. A no-op (True) in a single process, or where the process
    group has no store.

    Args:
        call: the public call as the user writes it (``"save_checkpoint"``), named in the messages.
        timeout_s: seconds to wait before raising; None: the store's timeout (the collective timeout given to
            ``init_distributed``).
        alone_after_s: seconds after which rank 0 goes on alone (None: it waits like the others).
        token: what the collective that follows will carry (its layout, say); every rank must bring the same,
            or every rank raises before the collective (which would abort the process or mix values).

    Returns:
        True when every rank arrived (the caller may run its collectives), False when rank 0 went on alone.

    Raises:
        SpeedupsError: some rank did not make the same call within the timeout (the message names the call,
            the ranks that arrived and the fix); the ranks brought different tokens.
    """
    world = env.world_size()
    if world == 1:
        return True
    store = compat.default_store()
    if store is None:
        return True
    _calls[call] += 1
    key = f"speedups/arrive/{call}/{_calls[call]}"
    decided = key + "/decided"
    if timeout_s is None:
        wait = getattr(store, "timeout", None)
        timeout_s = wait.total_seconds() if isinstance(wait, timedelta) else 1800.0
    if token is not None:  # the first token in stays; a rank whose token differs marks the call as bad
        first = bytes(store.compare_set(key + "/token", "", token)).decode()
        if first != token:
            store.set(key + "/bad", f"rank {env.rank()}: {token}; another rank: {first}")
    arrived = store.add(key, 1)
    if arrived == world:
        store.compare_set(decided, "", "all")  # the last to arrive decides, unless rank 0 went on alone
    start = time.monotonic()
    pause, noticed = 0.001, False
    me = env.rank()
    while not store.check([decided]):
        waited = time.monotonic() - start
        if alone_after_s is not None and me == 0 and waited > alone_after_s:
            store.compare_set(decided, "", "alone")
            break
        if not noticed and waited > NOTICE_AFTER_S:  # (first: a wait past the timeout is past it too)
            noticed = True
            late = _message(call, store.add(key, 0), world, f"still waiting after {NOTICE_AFTER_S:g} s")
            sys.stderr.write(f"speedups: {late} (it fails at the collective timeout, {timeout_s:g} s)\n")
            sys.stderr.flush()
        if waited > timeout_s:
            raise SpeedupsError(_message(call, store.add(key, 0), world, f"gave up after {timeout_s:g} s"))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    together = bytes(store.get(decided)) == b"all"
    if token is not None and together and store.check([key + "/bad"]):  # final: every rank set it before
        raise SpeedupsError(  # arriving, and all have arrived
            f"{call}() on rank {env.rank()}: the ranks do not agree on what to reduce "
            f"({bytes(store.get(key + '/bad')).decode()}). Nothing was reduced."
        )
    return together


def _message(call: str, arrived: int, world: int, what: str) -> str:
    return (
        f"{call}() on rank {env.rank()}: {what} for the other ranks; {arrived} of {world} ranks reached "
        f"it. {call}() is collective: every rank must call it at the same point (not under "
        f"`if is_main_process():`); a rank that failed before it (see its own error) never comes."
    )

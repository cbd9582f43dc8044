"""Flags any rank may raise, agreed by every rank at the same call, with no blocking collective per call.

Each rank calls :meth:`Agreement.poll` once per micro-step with its own flags (a signal came; a save is due).
Every ``interval`` calls, all ranks launch one asynchronous all-reduce (max) of their flags on a gloo process
group of their own (CPU tensors: no device sync, whatever the main backend), and read it at the next such
call, long after it finished. The interval is ``latency_s`` divided by the slowest single call any rank saw
in the last interval (carried by the same all-reduce), so a flag is seen about ``2 * latency_s`` after it is
raised even when calls come unevenly (a loader that hands out batches in bursts); it at most doubles from one
round to the next, so a run that slows down is caught up with quickly. Every rank computes it from the
agreed values, so every rank reads at the same call. Alone, the flags are their own agreement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from speedups._helpers import env

__all__ = ["Agreement"]

MAX_INTERVAL = 100_000
"""The most calls between two rounds (a very fast loop still reads the flags every ``MAX_INTERVAL`` calls)."""


class Agreement:
    """An agreement channel over ``flags`` values per rank (see the module docstring).

    Its first :meth:`poll` (or :attr:`alone`) makes its process group when a process group of several ranks
    runs (a collective: every rank polls from the same call on), so it may be built before the process group.

    Args:
        flags: how many values each rank contributes per round.
        latency_s: seconds per round, roughly (a flag is agreed within about two rounds).
    """

    def __init__(self, flags: int, latency_s: float = 0.5) -> None:
        self.flags = flags
        self.latency_s = latency_s
        self.group: Any = None
        self._alone: bool | None = None  # decided at the first poll
        self.calls = 0
        self.next_round = 1  # the call at which the round in flight is read and the next one starts
        self.interval = 1  # calls between two rounds
        self.work: Any = None
        self.buffer: torch.Tensor | None = None
        self.last_call = 0.0  # when the last call came (monotonic seconds)
        self.slowest = 0.0  # the longest time between two calls since the round in flight started

    @property
    def alone(self) -> bool:
        """Whether this process is the whole job (its flags need no agreement); decided once, at the first
        read, when the process group (if any) runs: then this makes the agreement's own group."""
        if self._alone is None:
            self._alone = not (env.pg_ready() and torch.distributed.get_world_size() > 1)
            if not self._alone:
                self.group = torch.distributed.new_group(backend="gloo")  # collective; CPU tensors
        return self._alone

    def poll(self, flags: Sequence[float]) -> list[float] | None:
        """Count one call; return the flags agreed over every rank (the max of each) when a round is read
        at this call (the same call on every rank), else None. Alone: ``flags`` at every call."""
        if self.alone:
            return list(flags)
        now = time.monotonic()  # one clock read per call: the gaps between calls set the interval
        if self.last_call and now - self.last_call > self.slowest:
            self.slowest = now - self.last_call
        self.last_call = now
        self.calls += 1
        if self.calls < self.next_round:
            return None
        agreed = None
        if self.work is not None and self.buffer is not None:
            self.work.wait()  # started an interval ago on every rank: done by now
            agreed = self.buffer.tolist()
        self.buffer = torch.tensor([*flags, self.slowest], dtype=torch.float64)
        self.work = torch.distributed.all_reduce(
            self.buffer, op=torch.distributed.ReduceOp.MAX, group=self.group, async_op=True
        )
        self.slowest = 0.0
        slowest = agreed[-1] if agreed is not None else 0.0  # the same on every rank
        wanted = int(self.latency_s / slowest) if slowest > 0 else 1
        self.interval = min(max(wanted, 1), 2 * self.interval, MAX_INTERVAL)
        self.next_round = self.calls + self.interval
        return None if agreed is None else agreed[:-1]

    def close(self) -> None:
        """Wait for the round in flight (every rank started it), so the process group can end cleanly."""
        work, self.work = self.work, None
        if work is not None:
            work.wait()

"""Loops and helpers shared by the profiler, advice and mistake tests."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset


class WorkClock:
    """A profiler clock that moves only by the work charged to it (``charge(seconds)``): patched in as the
    profiler module's ``time``, each step's data and compute times are what the test says, whatever the
    machine's speed or load."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def charge(self, seconds: float) -> None:
        self.now += seconds


class SlowDataset(Dataset):
    """Each item costs `delay` seconds (a stand-in for decoding and augmenting): slept, or charged to
    ``clock`` (a :class:`WorkClock`) when one is given."""

    def __init__(self, n: int, delay: float, clock: WorkClock | None = None) -> None:
        self.n, self.delay, self.clock = n, delay, clock

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.clock is not None:
            self.clock.charge(self.delay)
        else:
            time.sleep(self.delay)
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def busy_step(
    model: nn.Module, x: torch.Tensor, ms: float = 4.0, clock: WorkClock | None = None
) -> torch.Tensor:
    """A step whose compute takes about `ms` milliseconds of wall time, or exactly `ms` on ``clock``."""
    loss = model(x).pow(2).mean()
    loss.backward()
    if clock is not None:
        clock.charge(ms / 1e3)
        return loss
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass
    return loss

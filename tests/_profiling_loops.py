"""Loops and helpers shared by the profiler, advice and mistake tests."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset


class SlowDataset(Dataset):
    """Each item costs `delay` seconds (a stand-in for decoding and augmenting)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def busy_step(model: nn.Module, x: torch.Tensor, ms: float = 4.0) -> torch.Tensor:
    """A step whose compute takes about `ms` milliseconds of wall time."""
    loss = model(x).pow(2).mean()
    loss.backward()
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass
    return loss

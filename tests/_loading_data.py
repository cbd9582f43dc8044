"""Picklable datasets and worker_init_fns for the loading tests (module level, so spawn can import them)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

# Set in each worker process by record_init; read back through SeedProbe's items.
INIT_MARK: dict[str, int] = {}


class SeedProbe(Dataset):
    """Item i: (i, worker id, worker seed, a numpy draw, a random draw, a torch draw, the init mark)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int, int, int, int, int]:
        info = get_worker_info()
        wid, seed = (info.id, info.seed) if info is not None else (-1, -1)
        return (
            i,
            wid,
            seed,
            int(np.random.randint(2**31)),
            random.getrandbits(31),
            int(torch.randint(2**31, ())),
            INIT_MARK.get("worker", -1) * 1000 + INIT_MARK.get("draw", 0) % 1000,
        )


def record_init(worker_id: int, offset: int = 100) -> None:
    """A user's worker_init_fn: marks the worker and records a numpy draw made at init time."""
    INIT_MARK["worker"] = offset + worker_id
    INIT_MARK["draw"] = int(np.random.randint(2**31))


def identity_collate(batch: list) -> list:
    return batch


class Squares(Dataset):
    """Item i: the tensor [i, i*i] as float32."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(i * i)])


class Stream(IterableDataset):
    """An iterable dataset yielding 0..n-1 as float32 tensors (no sharding by worker)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor(float(i))


class EpochItems(Dataset):
    """Item i: (i, the epoch set in the main process by set_epoch): per-epoch dataset state."""

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, self.epoch])

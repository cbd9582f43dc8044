"""The sampler of :func:`~speedups.distributed`: each rank's share of an epoch, padded or not, from any
position (a resumed epoch)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["RankSampler"]


class RankSampler(DistributedSampler):
    """A ``DistributedSampler`` that can leave padding out (``even=False``) and start mid-epoch."""

    def __init__(self, dataset: Any, *, num_replicas: int, rank: int, shuffle: bool, seed: int, even: bool):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.even = even
        self.start = 0  # samples of this epoch to skip (a resumed epoch)
        if not even:
            self.num_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)

    def start_at(self, sample: int) -> None:
        """Make the next pass start at this rank's ``sample``-th sample of the epoch (0: its start)."""
        self.start = sample

    def __iter__(self) -> Iterator[int]:
        if self.even:
            indices = list(super().__iter__())
        else:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)  # the same permutation DistributedSampler draws
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            indices = order[self.rank : n : self.num_replicas]
        return iter(indices[self.start :])  # eager: ``start`` is read now, not at the first next()

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)

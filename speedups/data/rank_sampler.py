"""The sampler of :func:`~speedups.distributed`: each rank's share of an epoch, padded or not, from any
position (a resumed epoch), and, after a resume on another number of processes, the micro-batches the
saving layout would have made."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["RankSampler"]


class RankSampler(DistributedSampler):
    """A ``DistributedSampler`` that can leave padding out (``even=False``), start mid-epoch, and deal an
    epoch as another number of ranks would (:meth:`emulate`).

    Attributes:
        emulated: ``(world, batch)`` of the layout whose micro-batches this sampler deals, or None.
    """

    def __init__(self, dataset: Any, *, num_replicas: int, rank: int, shuffle: bool, seed: int, even: bool):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.even = even
        self.start = 0  # samples of this epoch to skip (a resumed epoch)
        self.emulated: tuple[int, int] | None = None
        self._own_samples = self.num_samples
        if not even:
            self.num_samples = self._own_samples = len(range(rank, len(dataset), num_replicas))
            self.total_size = len(dataset)

    def start_at(self, sample: int) -> None:
        """Make the next pass start at this rank's ``sample``-th sample of the epoch (0: its start)."""
        self.start = sample

    def emulate(self, world: int | None, batch: int = 1) -> bool:
        """Deal each epoch's micro-batches as ``world`` ranks with batches of ``batch`` would have made them
        (None: this sampler's own ranks); return whether it does.

        A run resumed on another number of processes keeps its global batch, and with it the samples of each
        optimizer step; here each micro-batch also keeps its composition: micro-batch ``k`` of saved rank
        ``v`` is the ``(k * world + v)``-th of the epoch, and this rank takes every ``num_replicas``-th from
        its own rank on. A model whose output depends on the micro-batch as a whole (batch norm, a branch on
        the batch) then follows the run that never stopped to float rounding. Only where each saved rank's
        share is whole batches and the micro-batches deal evenly (``even=True``, the padded share a multiple
        of ``batch``, the epoch's micro-batches a multiple of ``num_replicas``): else nothing changes (False).
        """
        self.emulated = None
        self.num_samples = self._own_samples
        if world is None or world == self.num_replicas or not self.even:
            return False
        share = -(-len(self.dataset) // world)  # type: ignore[arg-type]  # each saved rank's padded share
        if share % batch or (share // batch * world) % self.num_replicas:
            return False
        self.emulated = (world, batch)
        self.num_samples = share // batch * world // self.num_replicas * batch
        return True

    def __iter__(self) -> Iterator[int]:
        if self.emulated is not None:
            indices = self._emulated_indices(*self.emulated)
        elif self.even:
            indices = list(super().__iter__())
        else:
            indices = self._order()[self.rank : len(self.dataset) : self.num_replicas]  # type: ignore[arg-type]
        return iter(indices[self.start :])  # eager: ``start`` is read now, not at the first next()

    def _order(self) -> list[int]:
        """The epoch's permutation (``seed + epoch``, as ``DistributedSampler`` draws it), or 0..n-1."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)  # the same permutation DistributedSampler draws
        return torch.randperm(n, generator=g).tolist()

    def _emulated_indices(self, world: int, batch: int) -> list[int]:
        """This rank's micro-batches of the epoch as ``world`` ranks would have made them, in their order."""
        order = self._order()
        share = -(-len(order) // world)
        padded = (order * (-(-share * world // max(len(order), 1))))[: share * world]  # DistributedSampler's
        per_rank = [padded[v : share * world : world] for v in range(world)]
        out: list[int] = []
        for g in range(self.rank, share // batch * world, self.num_replicas):
            k, v = divmod(g, world)
            out.extend(per_rank[v][k * batch : (k + 1) * batch])
        return out

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)

"""An iterable dataset split across ranks and loader workers: every sample read once per epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["RankStream", "splits_itself"]


def splits_itself(dataset: object) -> bool:
    """Whether ``dataset`` declares (``splits_by_rank = True``) that it yields only its rank's share."""
    return getattr(dataset, "splits_by_rank", False) is True


class RankStream(IterableDataset):
    """``dataset``'s stream dealt round-robin to the job's (rank, worker) slots, as
    ``datasets.distributed.split_dataset_by_node`` deals a stream that is not sharded.

    Each rank and each of its loader workers reads the whole stream and keeps its own items: item ``i`` goes
    to slot ``i % (world_size * num_workers)``, slot ``rank * num_workers + worker``. With ``even`` (training)
    only whole rounds are dealt, so every rank yields as many items (DDP's all-reduce needs equal batch
    counts) and the last ``< world_size * num_workers`` items of an epoch are left out; without it every
    item is yielded once. Reading cost: every slot reads every item, as a stream without shards must.
    """

    def __init__(self, dataset: IterableDataset, *, rank: int, world_size: int, even: bool) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.even = even

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to the stream, where it has ``set_epoch`` (a shuffled buffer, say)."""
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        slots = self.world_size * workers
        mine = self.rank * workers + worker
        if not self.even:
            for i, item in enumerate(self.dataset):
                if i % slots == mine:
                    yield item
            return
        held: Any = None
        for i, item in enumerate(self.dataset):
            position = i % slots
            if position == mine:
                held = item
            if position == slots - 1:  # the round is whole: every slot gets its item
                yield held
                held = None

"""The sampler side of per-sample random streams: a sampler's indices handed out as ``(index, epoch)`` keys.

The keys are made in the main process, where the epoch is known, and travel with each index to whichever
worker loads it; :class:`~speedups.data.seeded_samples.SeededSamples` seeds the item from its key.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from speedups._helpers import validate
from speedups.data.rank_sampler import RankSampler
from speedups.data.seeded_samples import SAMPLE_KEY

__all__ = ["SampleKeys"]


class SampleKeys(Sampler):
    """Wrap a sampler (or a batch sampler) so each index ``i`` of a pass comes out as a key
    ``(SAMPLE_KEY, i, epoch)`` for :class:`~speedups.data.seeded_samples.SeededSamples`.

    The epoch of a pass is the wrapped sampler's ``epoch`` when it follows one (a ``DistributedSampler``,
    whose ``set_epoch`` the caller drives: ``drive=False``). Otherwise this object counts passes, 0, 1, 2, ...
    (``drive=True``), calls the wrapped sampler's ``set_epoch`` before each pass when it has one, and
    ``set_epoch(k)`` makes the next pass epoch k. A pass counts when its first index is drawn, not when
    ``iter()`` is called: torch's multi-worker iterator makes one it never reads. ``len()`` is the wrapped
    sampler's.

    Args:
        sampler: yields int indices, or lists of them (``batched=True``).
        batched: the sampler is a batch sampler.
        drive: count passes here (True), or read the wrapped sampler's ``epoch`` (False).
    """

    def __init__(self, sampler: Any, *, batched: bool = False, drive: bool = True) -> None:
        self.sampler, self.batched, self.drive = sampler, batched, drive
        self.next_epoch = 0
        """The epoch of the next pass (``drive=True``)."""

    @classmethod
    def seeded_order(cls, dataset: Any, *, shuffle: bool, seed: int) -> SampleKeys:
        """``fast_loader(..., sample_seeds=True)``'s own order: a one-rank ``DistributedSampler``'s (a
        permutation of ``seed + epoch`` when shuffled), its passes counted here."""
        return cls(RankSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, even=True))

    @property
    def is_seeded_order(self) -> bool:
        """Whether this is :meth:`seeded_order`'s: the order and the samples depend on (seed, epoch) alone."""
        return self.drive and type(self.sampler) is RankSampler

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (and set it on the wrapped sampler, if it has ``set_epoch``).

        Raises:
            TypeError, ValueError: ``epoch`` is not an int >= 0.
        """
        where = "batch_sampler" if self.batched else "sampler"
        with validate.arguments(f"loader.{where}.set_epoch(epoch={epoch!r})"):
            validate.integer(epoch, "epoch", minimum=0, maximum=2**63 - 1, example="0")
        self.next_epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:  # a generator: nothing happens before the first index is drawn
        if self.drive:
            epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
            if callable(getattr(self.sampler, "set_epoch", None)):
                self.sampler.set_epoch(epoch)
        else:
            epoch = int(self.sampler.epoch)
        if self.batched:
            for batch in self.sampler:
                yield [(SAMPLE_KEY, i, epoch) for i in batch]
        else:
            yield from zip(itertools.repeat(SAMPLE_KEY), self.sampler, itertools.repeat(epoch))

    def __repr__(self) -> str:
        return f"SampleKeys({self.sampler!r}, batched={self.batched}, drive={self.drive})"

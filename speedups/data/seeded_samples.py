"""The dataset side of per-sample random streams: each item is loaded with RNGs seeded from its own key.

``fast_loader(..., sample_seeds=True)`` and ``distributed(loader, sample_seeds=True)`` wrap the dataset in
a :class:`SeededSamples` and the sampler in a :class:`~speedups.data.sample_keys.SampleKeys`, which hands
out ``(index, epoch)`` keys. Random augmentation in ``__getitem__`` then depends on (seed, epoch, index)
alone, not on which worker process loads the item: the batches are the same for any ``num_workers``,
persistent or not, any ``prefetch_factor`` or world size, and after a mid-epoch resume.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

from torch.utils.data import IterableDataset

from speedups._helpers.rng import (
    epoch_seed,
    host_rng_states,
    numpy_or_none,
    seed_host_rngs,
    seed_in_epoch,
    set_host_rng_states,
)
from speedups.data.read_through import ReadThrough

__all__ = ["SAMPLE_KEY", "SeededSamples", "refuse_stream"]

SAMPLE_KEY = "speedups.sample_key"
"""The first element of a key ``(SAMPLE_KEY, index, epoch)``: it tells a key from an index of the user's."""


class SeededSamples(ReadThrough):
    """A map-style dataset whose item ``index`` of ``epoch`` is loaded with per-sample seeded RNGs.

    For each key ``(SAMPLE_KEY, index, epoch)`` (what :class:`~speedups.data.sample_keys.SampleKeys` hands
    out) the item is ``dataset[index]``, loaded after seeding torch's CPU generator, ``random`` and numpy's
    global ``RandomState`` from ``sample_seed(samples_seed, epoch, index)`` (a SplitMix64 hash); the states
    those generators had before are put back after each batch, so the process's own streams (a worker's, or
    the main process's with ``num_workers=0``) go on as if nothing had been loaded. torchvision's transforms
    (v1 and v2), ``random`` and ``numpy.random`` draw from these; a ``numpy.random.Generator`` or
    ``torch.Generator`` the dataset keeps itself does not follow, nor does randomness in ``collate_fn`` or
    on a GPU. A plain index (``loader.dataset[3]``, a ``Subset`` of this dataset) loads the item unseeded,
    as the wrapped dataset would. Cost (CPU): about 10 us per item and 80 us per batch.

    Every attribute but ``dataset``, ``samples_seed`` and ``samples_seed_given`` is read from, written to
    and deleted from the wrapped dataset (``loader.dataset.classes``, ``loader.dataset.train = False``);
    ``isinstance(loader.dataset, MyDataset)`` is False: use ``loader.dataset.dataset``. The dataset's own
    ``__getitems__`` is not used: items load one by one.

    Args:
        dataset: a map-style dataset with integer indices.
        samples_seed: the run's seed, an int in [0, 2**63); the same on every rank.
        samples_seed_given: the seed was given (``seed=``), not read from ``torch.initial_seed()``, which
            may differ between ranks: ``distributed()`` keeps a given seed and replaces another with its own.
    """

    _OWN: ClassVar[frozenset[str]] = frozenset({"dataset", "samples_seed", "samples_seed_given"})

    def __init__(self, dataset: Any, samples_seed: int, samples_seed_given: bool = True) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "samples_seed", int(samples_seed))
        object.__setattr__(self, "samples_seed_given", samples_seed_given)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """Load a batch of keys; the host RNG states are saved before and restored after the whole batch."""
        if not keys or not _is_key(keys[0]):  # plain indices: the wrapped dataset's own items, unseeded
            return [self.dataset[index] for index in keys]
        np = numpy_or_none()
        saved = host_rng_states()
        try:
            out = []
            epoch, shared = None, 0
            for _, index, key_epoch in keys:
                if key_epoch != epoch:  # one per batch: the keys of a batch share their epoch
                    epoch, shared = key_epoch, epoch_seed(self.samples_seed, key_epoch)
                try:
                    index = operator.index(index)
                except TypeError:
                    kind = type(index).__name__
                    raise TypeError(
                        f"sample_seeds=True: the sampler yielded the index {index!r} ({kind}); per-sample "
                        f"seeds need integer indices. Use a sampler of ints, or sample_seeds=False."
                    ) from None
                seed_host_rngs(seed_in_epoch(shared, index), np)
                out.append(self.dataset[index])
            return out
        finally:
            set_host_rng_states(saved)

    def __getitem__(self, key: Any) -> Any:
        if not _is_key(key):
            return self.dataset[key]
        return self.__getitems__([key])[0]

    def __repr__(self) -> str:
        return f"SeededSamples({self.dataset!r}, samples_seed={self.samples_seed})"


def _is_key(key: Any) -> bool:
    return type(key) is tuple and len(key) == 3 and key[0] == SAMPLE_KEY


def refuse_stream(dataset: Any, fix: str) -> None:
    """Raise ``ValueError`` for an ``IterableDataset``: per-sample seeds need items with indices."""
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"sample_seeds=True needs a map-style dataset, whose items have indices; "
            f"{type(dataset).__name__} is an IterableDataset. Seed inside the stream, {fix}."
        )

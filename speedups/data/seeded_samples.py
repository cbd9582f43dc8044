"""The dataset side of per-sample random streams: each item is loaded with RNGs seeded from its own key.

``fast_loader(..., sample_seeds=True)`` and ``distributed(loader, sample_seeds=True)`` wrap the dataset in
a :class:`SeededSamples` and the sampler in a :class:`~speedups.data.sample_keys.SampleKeys`, which hands
out ``(index, epoch)`` keys. Random augmentation in ``__getitem__`` then depends on (seed, epoch, index)
alone, not on which worker process loads the item: the batches are the same for any ``num_workers``,
persistent or not, any ``prefetch_factor`` or world size, and after a mid-epoch resume.
"""

from __future__ import annotations

import operator
from typing import Any

from torch.utils.data import Dataset

from speedups._helpers.rng import (
    HOST_STREAMS,
    epoch_seed,
    host_rng_states,
    mix64,
    moved_host_streams,
    numpy_or_none,
    seed_host_rngs,
    set_host_rng_states,
)

__all__ = ["SeededSamples"]


class SeededSamples(Dataset):
    """A map-style dataset whose item ``index`` of ``epoch`` is loaded with per-sample seeded RNGs.

    For each key ``(index, epoch)`` (a plain int ``index`` counts as epoch 0) the item is
    ``dataset[index]``, loaded after seeding torch's CPU generator, ``random`` and numpy's global
    ``RandomState`` from ``sample_seed(seed, epoch, index)`` (a SplitMix64 hash); the states those
    generators had before are put back after each batch (after each item without automatic batching), so the
    process's own streams (a worker's, or the main process's with ``num_workers=0``) go on as if nothing had
    been loaded. torchvision's transforms (v1 and v2), ``random`` and ``numpy.random`` all draw from these;
    a ``numpy.random.Generator`` or ``torch.Generator`` the dataset keeps itself does not follow, nor does
    randomness in ``collate_fn`` or on a GPU. ``random`` and numpy are seeded only once the items are seen
    drawing from them: each process watches its first batch item by item (all seeded), and a later batch
    in which an unseeded one moved is loaded again with it seeded. Cost (CPU): about 3 us per item with
    torch alone, 10 us with all three, and 80 us per batch.

    Every other attribute is read from, and written to, the wrapped dataset (``loader.dataset.classes``,
    ``loader.dataset.train = False``); ``isinstance(loader.dataset, MyDataset)`` is False: use
    ``loader.dataset.dataset``. The dataset's own ``__getitems__`` is not used: items load one by one.

    Args:
        dataset: a map-style dataset with integer indices.
        seed: the run's seed, an int in [0, 2**63); the same on every rank.
        explicit: the seed was given (``seed=``), not read from ``torch.initial_seed()``, which may differ
            between ranks: ``distributed()`` keeps an explicit seed and replaces another with its own.
    """

    _OWN = frozenset({"dataset", "seed", "explicit", "_streams"})
    _streams: frozenset[str] | None

    def __init__(self, dataset: Any, seed: int, explicit: bool = True) -> None:
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "seed", int(seed))
        object.__setattr__(self, "explicit", explicit)
        # Which of ``random`` and numpy the items draw from, learnt in each process from its first batch
        # (None: not yet); torch's generator is always seeded. Seeding only those saves up to 6 us per item.
        object.__setattr__(self, "_streams", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in self._OWN:  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:  # the user's dataset state (``loader.dataset.train = False``) belongs to the user's dataset
            setattr(self.dataset, name, value)

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """Load a batch of keys; the host RNG states are saved before and restored after the whole batch."""
        np = numpy_or_none()
        saved = host_rng_states()
        streams, restore = self._streams, HOST_STREAMS
        try:
            if streams is None:  # this process's first batch: every stream seeded, and watched per item
                out, used = self._load(keys, np, HOST_STREAMS, probe=True)
                self._streams = used
                return out
            out, _ = self._load(keys, np, streams, probe=False)
            moved = moved_host_streams(saved, HOST_STREAMS - streams)
            if moved:  # the dataset drew from a stream not seeded so far: load the batch again, seeded
                self._streams = streams | moved
                set_host_rng_states(saved)
                out, _ = self._load(keys, np, self._streams, probe=False)
            else:
                restore = streams  # the others did not move
            return out
        finally:
            set_host_rng_states(saved, restore)

    def _load(
        self, keys: list[Any], np: Any, streams: frozenset[str], probe: bool
    ) -> tuple[list[Any], frozenset[str]]:
        """The items of ``keys``, each loaded after seeding torch and ``streams``; with ``probe``, also the
        streams the items drew from."""
        out: list[Any] = []
        used: frozenset[str] = frozenset()
        epoch, shared = None, 0
        for key in keys:
            index, key_epoch = key if type(key) is tuple else (key, 0)
            if key_epoch != epoch:  # one per batch: the keys of a batch share their epoch
                epoch, shared = key_epoch, epoch_seed(self.seed, key_epoch)
            try:
                index = operator.index(index)
            except TypeError:
                kind = type(index).__name__
                raise TypeError(
                    f"sample_seeds=True: the sampler yielded the index {index!r} ({kind}); per-sample "
                    f"seeds need integer indices. Use a sampler of ints, or sample_seeds=False."
                ) from None
            seed_host_rngs(mix64(shared ^ (index & 0xFFFFFFFFFFFFFFFF)), np, streams)  # = sample_seed(...)
            if probe:
                seeded = host_rng_states()
                out.append(self.dataset[index])
                used |= moved_host_streams(seeded, HOST_STREAMS - used)
            else:
                out.append(self.dataset[index])
        return out, used

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __repr__(self) -> str:
        return f"SeededSamples({self.dataset!r}, seed={self.seed})"

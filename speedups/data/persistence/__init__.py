"""Loader workers that persist across epochs yet yield and draw what fresh ones would: the builder, the
sampler that draws each pass's base seed, and the dataset wrapper that reseeds each worker."""

from speedups.data.persistence.builder import (
    EXACT,
    build_loader,
    has_per_epoch_state,
    rebuilt_persistence,
    reseeds_workers,
    unwrapped,
)
from speedups.data.persistence.epoch_seeds import EpochSeeds
from speedups.data.persistence.worker_reseeding import EPOCH_KEY, WorkerReseeding, is_epoch_key

__all__ = [
    "EPOCH_KEY",
    "EXACT",
    "EpochSeeds",
    "WorkerReseeding",
    "build_loader",
    "has_per_epoch_state",
    "is_epoch_key",
    "rebuilt_persistence",
    "reseeds_workers",
    "unwrapped",
]

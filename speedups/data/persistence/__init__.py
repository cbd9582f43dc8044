"""Loader workers that persist across epochs yet yield and draw what fresh ones would: the builder, the
sampler that draws each pass's base seed, the dataset wrapper that reseeds each worker, and what restarts
the workers for a pass whose dataset changed (in the main process, or in the workers themselves)."""

from speedups.data.persistence.builder import (
    EXACT,
    build_loader,
    has_per_epoch_state,
    rebuilt_persistence,
    reseeds_workers,
    unwrapped,
)
from speedups.data.persistence.epoch_seeds import EpochSeeds
from speedups.data.persistence.fingerprint import Fingerprint
from speedups.data.persistence.worker_reseeding import EPOCH_KEY, WorkerReseeding, is_epoch_key
from speedups.data.persistence.worker_restarts import WorkerRestarts
from speedups.data.persistence.worker_watch import WorkerWatch

__all__ = [
    "EPOCH_KEY",
    "EXACT",
    "EpochSeeds",
    "Fingerprint",
    "WorkerReseeding",
    "WorkerRestarts",
    "WorkerWatch",
    "build_loader",
    "has_per_epoch_state",
    "is_epoch_key",
    "rebuilt_persistence",
    "reseeds_workers",
    "unwrapped",
]

"""Tips 1-2 and the data half of tip 9: fast DataLoader defaults, ``num_workers`` by measurement, each
rank's share of every epoch, and batches on the device one step ahead."""

from speedups.data.distributed_loader import DistributedLoader, distributed
from speedups.data.loaders import fast_loader
from speedups.data.prefetching import DevicePrefetcher, prefetch_to_device
from speedups.data.tuning import LoaderReport, tune_loader

__all__ = [
    "DevicePrefetcher",
    "DistributedLoader",
    "LoaderReport",
    "distributed",
    "fast_loader",
    "prefetch_to_device",
    "tune_loader",
]

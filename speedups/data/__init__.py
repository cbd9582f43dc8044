"""Tips 1-2 and the data half of tip 9: fast DataLoader defaults, ``num_workers`` by measurement, and each
rank's share of every epoch."""

from speedups.data.distributed_loader import DistributedLoader, distributed
from speedups.data.loaders import fast_loader
from speedups.data.tuning import LoaderReport, tune_loader

__all__ = ["DistributedLoader", "LoaderReport", "distributed", "fast_loader", "tune_loader"]

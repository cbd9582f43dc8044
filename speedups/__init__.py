"""speedups: make a hand-written PyTorch training loop fast without taking it away from its author.

Composable decorators and context managers, one module per tip; this file only re-exports them.
"""

from speedups.batch_size import AccumulationPlan, accumulation_plan, find_batch_size
from speedups.device import default_device, resolve_device, to_device
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.loading import LoaderReport, fast_loader, tune_loader
from speedups.tracking import LossTracker

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "LoaderReport",
    "LossTracker",
    "SpeedupsError",
    "SpeedupsWarning",
    "__version__",
    "accumulation_plan",
    "default_device",
    "fast_loader",
    "find_batch_size",
    "resolve_device",
    "to_device",
    "tune_loader",
]

"""speedups: make a hand-written PyTorch training loop fast without taking it away from its author.

Composable decorators and context managers, one module per tip; this file only re-exports them.
"""

from speedups.device import default_device, resolve_device, to_device
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.profiling import StepProfiler, check, profile_steps
from speedups.sharding import shard_model, unshard_model
from speedups.tracking import LossTracker

__version__ = "0.1.0"

__all__ = [
    "LossTracker",
    "SpeedupsError",
    "SpeedupsWarning",
    "StepProfiler",
    "__version__",
    "check",
    "default_device",
    "profile_steps",
    "resolve_device",
    "shard_model",
    "to_device",
    "unshard_model",
]

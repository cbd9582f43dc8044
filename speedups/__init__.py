"""speedups: make a hand-written PyTorch training loop fast without taking it away from its author.

Composable decorators and context managers, one module per tip; this file only re-exports them.
"""

from speedups.device import default_device, resolve_device, to_device
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.sharding import shard_model, unshard_model
from speedups.tracking import LossTracker

__version__ = "0.1.0"

__all__ = [
    "LossTracker",
    "SpeedupsError",
    "SpeedupsWarning",
    "__version__",
    "default_device",
    "resolve_device",
    "shard_model",
    "to_device",
    "unshard_model",
]

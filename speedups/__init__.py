"""speedups: make a hand-written PyTorch training loop fast without taking it away from its author.

Composable decorators and context managers, one module per tip; this file only re-exports them.
"""

from speedups.accumulation import accumulate
from speedups.device import default_device, resolve_device, to_device
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.precision import mixed_precision
from speedups.tracking import LossTracker

__version__ = "0.1.0"

__all__ = [
    "LossTracker",
    "SpeedupsError",
    "SpeedupsWarning",
    "__version__",
    "accumulate",
    "default_device",
    "mixed_precision",
    "resolve_device",
    "to_device",
]

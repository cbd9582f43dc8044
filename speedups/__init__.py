"""speedups: make a hand-written PyTorch training loop fast without taking it away from its author.

Composable decorators and context managers, one folder (or module) per tip; this file only re-exports them.
"""

from speedups.accumulation import UpdateRecord, accumulate
from speedups.checkpoint import (
    RunDirectory,
    StopOnSignal,
    checkpoint_values,
    load_checkpoint,
    save_checkpoint,
)
from speedups.data import (
    DevicePrefetcher,
    DistributedLoader,
    LoaderReport,
    distributed,
    fast_loader,
    prefetch_to_device,
    tune_loader,
)
from speedups.device import default_device, resolve_device, to_device
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.kernels import compile_blocks, deterministic, fast_kernels, uncompile_blocks
from speedups.memory import (
    AccumulationPlan,
    accumulation_plan,
    checkpoint_activations,
    find_batch_size,
    uncheckpoint_activations,
)
from speedups.metrics import MetricLogger, plot_metrics
from speedups.parallel import (
    ddp_wrap,
    destroy_distributed,
    gather,
    init_distributed,
    is_main_process,
    launch,
    local_rank,
    main_process_first,
    rank,
    rank_zero_only,
    rank_zero_print,
    seed_everything,
    world_size,
)
from speedups.precision import mixed_precision
from speedups.profiling import StepProfiler, check, profile_steps
from speedups.sharding import shard_model, unshard_model
from speedups.tracking import LossTracker

__version__ = "0.1.0"

__all__ = [
    "AccumulationPlan",
    "DevicePrefetcher",
    "DistributedLoader",
    "LoaderReport",
    "LossTracker",
    "MetricLogger",
    "RunDirectory",
    "SpeedupsError",
    "SpeedupsWarning",
    "StepProfiler",
    "StopOnSignal",
    "UpdateRecord",
    "__version__",
    "accumulate",
    "accumulation_plan",
    "check",
    "checkpoint_activations",
    "checkpoint_values",
    "compile_blocks",
    "ddp_wrap",
    "default_device",
    "destroy_distributed",
    "deterministic",
    "distributed",
    "fast_kernels",
    "fast_loader",
    "find_batch_size",
    "gather",
    "init_distributed",
    "is_main_process",
    "launch",
    "local_rank",
    "load_checkpoint",
    "main_process_first",
    "mixed_precision",
    "plot_metrics",
    "prefetch_to_device",
    "profile_steps",
    "rank",
    "rank_zero_only",
    "rank_zero_print",
    "resolve_device",
    "save_checkpoint",
    "seed_everything",
    "shard_model",
    "to_device",
    "tune_loader",
    "uncompile_blocks",
    "uncheckpoint_activations",
    "unshard_model",
    "world_size",
]

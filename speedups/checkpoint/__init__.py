"""Checkpoints: save and load (checks first, per-rank state, another layout), the file format, FSDP2 shards,
background writes, a run directory, and a clean stop on a signal."""

from speedups.checkpoint.loading import load_checkpoint
from speedups.checkpoint.run_directory import RunDirectory
from speedups.checkpoint.saving import save_checkpoint
from speedups.checkpoint.stop_signal import StopOnSignal
from speedups.checkpoint.values import checkpoint_values

__all__ = ["RunDirectory", "StopOnSignal", "checkpoint_values", "load_checkpoint", "save_checkpoint"]

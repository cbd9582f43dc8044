"""Checkpoints: save and load (checks first), the file format, FSDP2 shards."""

from speedups.checkpoint.loading import load_checkpoint
from speedups.checkpoint.saving import save_checkpoint
from speedups.checkpoint.values import checkpoint_values

__all__ = ["checkpoint_values", "load_checkpoint", "save_checkpoint"]

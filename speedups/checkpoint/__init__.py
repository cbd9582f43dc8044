"""Checkpoints: save and load (checks first), the file format, FSDP2 shards."""

from speedups.checkpoint.loading import load_checkpoint
from speedups.checkpoint.saving import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]

"""How an accumulation window's gradients reach every rank: one small strategy per case (one process, DDP,
FSDP2) behind :class:`GradSync`, chosen once by :func:`grad_sync_for`."""

from speedups.accumulation.grad_sync.base import DataParallelSync, GradSync, SyncKind, count_dtype
from speedups.accumulation.grad_sync.choice import grad_sync_for
from speedups.accumulation.grad_sync.ddp import DDPSync
from speedups.accumulation.grad_sync.fsdp2 import FSDP2Sync

__all__ = ["DDPSync", "DataParallelSync", "FSDP2Sync", "GradSync", "SyncKind", "count_dtype", "grad_sync_for"]

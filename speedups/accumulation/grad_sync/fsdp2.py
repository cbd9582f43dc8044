"""The FSDP2 strategy: gradient sync switched off between boundaries with ``set_requires_gradient_sync``."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from speedups._helpers import env
from speedups.accumulation.grad_sync.base import NULL_CONTEXT, DataParallelSync, LocalCount, SyncKind
from speedups.errors import SpeedupsError

__all__ = ["FSDP2Sync"]


class FSDP2Sync(DataParallelSync):
    """An FSDP2 module (``set_requires_gradient_sync``): sync off between boundaries; no flush possible."""

    kind = SyncKind.FSDP2

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, dist.get_world_size() if env.pg_ready() else 1)
        self.sync_off = False  # gradient sync currently turned off

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        if self.sync_off == boundary:
            self.model.set_requires_gradient_sync(boundary)
            self.sync_off = not boundary
        return NULL_CONTEXT

    def sync_window(
        self, params: Sequence[torch.Tensor], local_count: LocalCount, pending: int, every: int
    ) -> torch.Tensor | None:
        raise SpeedupsError(
            f"accumulate(...).flush(): {pending} micro-steps are pending on an FSDP2 model whose "
            f"gradient sync was off; FSDP2 has no public way to reduce them afterwards. Make the epoch a "
            f"multiple of {every} micro-batches, e.g. DataLoader(..., drop_last=True)."
        )

    def restart(self) -> None:
        self.sync_off = False
        self.model.set_requires_gradient_sync(True)

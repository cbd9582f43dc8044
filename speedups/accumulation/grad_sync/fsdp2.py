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
    """An FSDP2 module (``set_requires_gradient_sync``): gradient sync off between boundaries.

    FSDP2 keeps the unsynchronised gradients of a window in buffers of its own, with no public way to reduce
    them later, so the last backward of a window must run with sync on: at a boundary, in the last
    micro-batch of a split boundary call, and in the last call of an ``epoch()`` pass over a sized loader,
    whose short window a flush then applies (its gradients reduce-scattered and averaged by FSDP2 itself).
    """

    kind = SyncKind.FSDP2
    flush_averaged = True

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, dist.get_world_size() if env.pg_ready() else 1)
        self.sync_off = False  # gradient sync currently turned off

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        if self.sync_off == boundary:
            self.model.set_requires_gradient_sync(boundary)
            self.sync_off = not boundary
        return NULL_CONTEXT

    def piece_step(self, boundary: bool, last: bool) -> AbstractContextManager[Any]:
        return self.micro_step(boundary and last)

    def retry_allowed(self, backwards: int) -> bool:
        # Another rank would go on with the forward's all-gathers while this one ran its call again, and a
        # backward run with sync off left gradients in FSDP2's own buffers, which cannot be put back.
        return self.world == 1 and backwards == 0

    def sync_window(
        self, params: Sequence[torch.Tensor], local_count: LocalCount, pending: int, every: int
    ) -> torch.Tensor | None:
        """The window's last backward ran with sync on (its gradients are reduced): sum the item count.

        Raises:
            SpeedupsError: it ran with sync off, so its gradients sit in FSDP2's own unreduced buffers.
        """
        if self.sync_off:
            raise SpeedupsError(
                f"accumulate(...).flush(): {pending} micro-steps are pending on an FSDP2 model whose "
                f"gradient sync was off for the last of them; FSDP2 has no public way to reduce them "
                f"afterwards. Loop with `for batch in train_step.epoch(loader):` (a loader with a length), "
                f"which syncs the epoch's last call so its short window can be applied, or make the epoch a "
                f"multiple of {every} micro-batches (DataLoader(..., drop_last=True))."
            )
        if local_count is None or self.world == 1:
            return None
        device = params[0].device if params else torch.device("cpu")
        count = local_count(device)
        dist.all_reduce(count, group=self.group)
        return count

    def check_discard(self, pending: int, every: int) -> None:
        """Refuse to drop a window whose gradient sync was off (see ``GradSync.check_discard``).

        Raises:
            SpeedupsError: FSDP2 holds that window's gradients in buffers of its own.
        """
        if self.sync_off:
            raise SpeedupsError(
                f"accumulate(...).discard(): {pending} of {every} micro-steps are pending on an FSDP2 model "
                f"whose gradient sync was off for them: FSDP2 keeps those gradients in buffers of its own, "
                f"which no public API drops, so its next synchronised backward would add them in. Finish the "
                f"window (call the step until train_step.pending == 0) or apply it: train_step.flush() "
                f"after a call made with sync on (loop with `for batch in train_step.epoch(loader):`)."
            )

    def restart(self, pending: int = 0) -> None:
        self.sync_off = False
        self.model.set_requires_gradient_sync(True)

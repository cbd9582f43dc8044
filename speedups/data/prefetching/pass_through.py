"""The strategy of a :class:`~speedups.data.prefetching.DevicePrefetcher` without a CUDA device: no side
stream, no batch drawn ahead, no thread."""

from __future__ import annotations

from typing import Any

import torch

from speedups._helpers.moving import LeafMover, moves_itself
from speedups._helpers.tree import tree_map

__all__ = ["PassThrough"]


class PassThrough:
    """Hand each batch out as :func:`~speedups.to_device` moves it, when it is handed out, nothing ahead.

    On the CPU it moves nothing (a CPU loader's tensors are already there): ``moves`` is False and the
    prefetcher hands out the loader's own iterator, so the loop costs exactly what ``for batch in loader``
    costs. On another device without streams here (``mps``, ``meta``) each batch is moved by ``to_device``'s
    rules at hand-out, synchronously as ``to_device`` would.

    Args:
        device: the resolved target device.

    Attributes:
        ahead: 0, nothing is drawn ahead of the batch handed out.
        moves: whether a batch is moved at all (False on the CPU).
    """

    ahead = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.moves = device.type != "cpu"
        self._move = LeafMover(device)

    def start(self, batch: Any) -> Any:
        """Return ``batch`` moved to the device (``batch`` itself on the CPU)."""
        return tree_map(self._move, batch, moves_itself) if self.moves else batch

    def finish(self, handle: Any) -> Any:
        """Return the batch :meth:`start` moved; nothing to wait for."""
        return handle

    def __repr__(self) -> str:
        return f"PassThrough({str(self.device)!r})"

"""The CUDA strategy of a :class:`~speedups.data.prefetching.DevicePrefetcher`: copies on a side stream,
one batch ahead, as NVIDIA apex's ImageNet ``data_prefetcher`` and torchtnt's ``CudaDataPrefetcher`` do."""

from __future__ import annotations

from typing import Any

import torch

from speedups._helpers.moving import LeafMover, moves_itself
from speedups._helpers.tree import tree_leaves, tree_map

__all__ = ["SideStreamCopy"]


class SideStreamCopy:
    """Copy each batch to a CUDA device on a side stream while the step computes on its own stream.

    :meth:`start` queues the copy on :attr:`stream` (``to_device``'s rules: ``non_blocking`` exactly from
    pinned host memory, so pin it: ``fast_loader`` and ``DataLoader(pin_memory=True)`` do) and records an
    event after it. :meth:`finish` makes the step's current stream wait on that event (on the GPU; the host
    does not wait) and calls ``Tensor.record_stream`` on every moved tensor, so the caching allocator does
    not hand a batch's memory to the next copy while the step's kernels still read it (PyTorch's "CUDA
    semantics" notes). An object that moved itself with its own ``.to`` hides its tensors from that call:
    once one is seen, each later copy first waits (on the GPU) for the step's stream as well.

    Sync points: none with pinned memory. A copy from pageable memory blocks the host for that copy (the
    step's queued kernels keep running), as ``to_device`` does.

    Args:
        device: a resolved CUDA device.

    Attributes:
        ahead: 1, the next batch is copied while the step runs on this one.
        stream: the side stream the copies run on.

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    ahead = 1

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"SideStreamCopy(device={str(device)!r}): a side stream needs a CUDA device. "
                f"Use speedups.prefetch_to_device(loader, device), which picks the copy for the device."
            )
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._move = LeafMover(device)
        self._fence = False  # a batch held tensors record_stream could not reach

    def start(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        """Queue the copy of ``batch`` on :attr:`stream`; return the moved batch and its ready event."""
        with torch.cuda.device(self.device):
            if self._fence:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                moved = tree_map(self._move, batch, moves_itself)
            ready = self.stream.record_event()
        return moved, ready

    def finish(self, handle: tuple[Any, torch.cuda.Event]) -> Any:
        """Make the current stream wait for the copy, tell the allocator, and return the moved batch."""
        moved, ready = handle
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        for leaf in tree_leaves(moved):
            if isinstance(leaf, torch.Tensor):
                if leaf.device == self.device:
                    leaf.record_stream(compute)
            elif moves_itself(leaf):
                self._fence = True
        return moved

    def __repr__(self) -> str:
        return f"SideStreamCopy({str(self.device)!r})"

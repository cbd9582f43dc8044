"""Count host-device syncs: every ``.item()``, ``float()``, ``.tolist()`` of a tensor ends in
``aten._local_scalar_dense`` (or a device-to-host copy), which a TorchDispatchMode can see."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class SyncCounter(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls made while active (``.count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("_local_scalar_dense"):
            self.count += 1
        return func(*args, **(kwargs or {}))

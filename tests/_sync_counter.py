"""Count host-device syncs: the reads a loop writes (``.item()``, ``.tolist()``, ``float()``, ``int()``,
``bool()``, ``.numpy()``, a copy to the CPU) and the reads torch makes inside an op:
``aten._local_scalar_dense`` or a device-to-host copy, and the ops whose output size depends on the values
(``nonzero``, masked indexing, ``unique``, ...), whose count a GPU kernel copies to the host where no
dispatcher op shows it: each counted once.

A CPU-only test has no device, so by default a CPU tensor stands in for one and every read counts;
``device_only=True`` counts only reads of tensors on an accelerator (GPU tests, or checking that reads of
CPU state such as Adam's step counter are left out).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level calls that read a tensor's value into the host.
_READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"})
_COPIES = frozenset({"cpu", "to"})  # a sync when they copy from an accelerator to the CPU


class _Reads(TorchFunctionMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        src = args[0] if args else None
        if name not in _READS and name not in _COPIES:
            return func(*args, **(kwargs or {}))
        self.owner.depth += 1  # torch's own _local_scalar_dense / copy below belongs to this read
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.owner.depth -= 1
        if not isinstance(src, torch.Tensor):
            return out
        if name in _READS:
            self.owner.count += self.owner.counts(src)
        else:  # a copy to the host (a CPU-to-CPU cast is not one, even with the CPU standing in)
            self.owner.count += _to_host(src, out)
        return out


def _to_host(src: object, dst: object) -> bool:
    """Whether copying ``src`` into ``dst`` moved values from an accelerator to the CPU."""
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.device.type not in ("cpu", "meta")
        and dst.device.type == "cpu"
    )


class _Internal(TorchDispatchMode):
    def __init__(self, owner: SyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.owner.depth == 0 and args and isinstance(args[0], torch.Tensor):
            name = func.__name__
            if name.startswith("_local_scalar_dense"):
                self.owner.count += self.owner.counts(args[0])
            elif name.startswith("_to_copy"):
                self.owner.count += _to_host(args[0], out)
            elif name.startswith("copy_") and len(args) > 1:
                self.owner.count += _to_host(args[1], args[0])
            elif _sizes_from_values(func, args, kwargs or {}):
                self.owner.count += self.owner.counts(args[0])
        return out


# Ops whose output size depends on the values: on a GPU the kernel copies a count to the host inside
# (cudaMemcpy, no dispatcher op to see), so they are counted by name.
_DATA_DEPENDENT = frozenset(
    {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount"}
)


def _sizes_from_values(func: Any, args: Any, kwargs: dict) -> bool:
    base = func.__name__.split(".")[0]
    if base in _DATA_DEPENDENT:
        return True
    if base in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        return any(  # a boolean mask as index: torch calls nonzero on it inside the kernel
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()
        )
    if base == "repeat_interleave" and isinstance(args[0], torch.Tensor):
        return kwargs.get("output_size") is None and (len(args) < 2 or isinstance(args[1], torch.Tensor))
    return False


class SyncCounter:
    """Count host-device syncs made while active (``.count``); see the module docstring."""

    def __init__(self, *, device_only: bool = False) -> None:
        self.count = 0
        self.depth = 0
        self.device_only = device_only
        self._modes = (_Reads(self), _Internal(self))

    def counts(self, tensor: torch.Tensor) -> bool:
        kind = tensor.device.type
        return kind != "meta" and (kind != "cpu" or not self.device_only)

    def __enter__(self) -> SyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

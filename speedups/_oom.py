"""The one rule for "this error means the allocator ran out of memory", shared by every tip that recovers.

``find_batch_size`` probes with it; ``accumulate(..., micro_batch_size="auto")`` halves on it.
"""

from __future__ import annotations

import torch

__all__ = ["is_out_of_memory"]

# Messages of the RuntimeError that the CPU allocator (and some backends) raise when memory runs out.
_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "not enough memory", "out of memory")


def _oom_types() -> tuple[type[BaseException], ...]:
    found = []
    for owner in (torch, torch.cuda):
        cls = getattr(owner, "OutOfMemoryError", None)  # torch.OutOfMemoryError is newer than the CUDA one
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def is_out_of_memory(error: BaseException) -> bool:
    """Return True when ``error`` means the allocator ran out of memory (CUDA, CPU or another backend).

    Recognises ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` on older torch) and the
    ``RuntimeError`` of the CPU allocator ("DefaultCPUAllocator: can't allocate memory", "not enough
    memory") and of other backends ("... out of memory").

    Example:
        >>> is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
        True
        >>> is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(error, _oom_types()):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)

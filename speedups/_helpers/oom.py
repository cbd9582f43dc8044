"""One rule for "this error means the batch was too big": out of memory on any backend, as the field knows it.

Shared by :func:`speedups.find_batch_size` and the micro-batching that splits a batch which does not fit, so
both back off on exactly the same errors. The texts are those other batch-size finders act on (Lightning's
``is_oom_error``, Accelerate's ``should_reduce_batch_size``, toma), from torch's own messages.
"""

from __future__ import annotations

import torch

__all__ = ["is_out_of_memory"]

# Parts of the RuntimeError messages that mean the allocator (or a library's workspace allocation) failed:
# the CUDA caching allocator before torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ..."),
# the CUDA runtime ("CUDA error: out of memory"), HIP/MPS/XPU ("... out of memory"), the CPU allocator, and
# cuBLAS / cuDNN failing to allocate their workspace.
_OOM_TEXTS = (
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "not enough memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "MPS backend out of memory",
)
# cuDNN's answer to a batch above its size limits (BatchNorm, conv, RNN at large N; pytorch/pytorch#4107):
# "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
# Every batch-size finder treats it as "too big, back off"; elsewhere it can be a real bug, so only this text.
_CUDNN_TOO_BIG = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."


def _oom_types() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = []
    for owner in (torch, torch.cuda):
        cls = getattr(owner, "OutOfMemoryError", None)  # torch.OutOfMemoryError is newer than the CUDA one
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found:
            found.append(cls)
    return tuple(found)


_TYPES = _oom_types()


def is_out_of_memory(error: BaseException) -> bool:
    """Return True when ``error`` means the step needed more memory than the device has at this size.

    True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` on older torch), for a
    ``RuntimeError`` whose message is an allocator's out-of-memory text (CUDA caching allocator, CUDA
    runtime "CUDA error: out of memory", CPU "DefaultCPUAllocator: can't allocate memory", MPS, HIP, XPU,
    cuBLAS/cuDNN ``*_ALLOC_FAILED``), and for cuDNN's large-batch "CUDNN_STATUS_NOT_SUPPORTED" error; also
    when such an error is the ``__cause__`` of ``error`` (``raise ... from oom``, as wrappers do).

    Example:
        >>> is_out_of_memory(RuntimeError("CUDA error: out of memory"))
        True
        >>> is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)"))
        False
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _TYPES):
            return True
        if isinstance(current, RuntimeError):
            text = str(current)
            if _CUDNN_TOO_BIG in text or any(t in text for t in _OOM_TEXTS):
                return True
        current = current.__cause__
    return False

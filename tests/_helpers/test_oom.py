"""The one out-of-memory rule (speedups._helpers.oom) that find_batch_size and micro-batching share."""

from __future__ import annotations

import pytest
import torch

from speedups._helpers.oom import is_out_of_memory

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@pytest.mark.parametrize(
    "error",
    [
        OOM("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.cuda.OutOfMemoryError("x"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity)"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)"),
        RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: 9"),
        RuntimeError("not enough memory: you tried to allocate 1 GB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError(
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
            "non-contiguous input."
        ),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:28]}",
)
def test_the_fields_out_of_memory_errors_count(error: BaseException) -> None:
    assert is_out_of_memory(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)"),
        RuntimeError("Expected more than 1 value per channel when training"),
        RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("out of memory"),  # not an allocator's error type
        MemoryError(),  # Python's own
        KeyboardInterrupt(),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:28]}",
)
def test_other_errors_do_not(error: BaseException) -> None:
    assert not is_out_of_memory(error)


def test_an_out_of_memory_cause_counts_through_a_wrapper() -> None:
    try:
        try:
            raise OOM("CUDA out of memory.")
        except RuntimeError as oom:
            raise ValueError("the backend compiler failed") from oom
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)
    context_only = ValueError("raised while handling")
    context_only.__context__ = OOM("x")  # implicit context: a different error, not counted
    assert not is_out_of_memory(context_only)

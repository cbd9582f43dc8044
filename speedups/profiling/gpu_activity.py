"""What one sampled step's GPU trace says: busy time, kernel count, and the kinds of work the advice weighs.

:func:`read_activity` is a pure function over :class:`DeviceEvent` records (what ``torch.profiler``'s CUDA
activity gives: a name, a device, a stream, a start and an end), so it is tested without a GPU.
:class:`~speedups.profiling.kernel_timer.KernelTimer` turns the profiler's events into records and calls it.

The kinds of kernel are told apart by their names, a heuristic over the names cuBLAS, cuDNN and CUTLASS give
their kernels (``ampere_sgemm_128x64_nn``, ``sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_...``,
``cudnn::engines_precompiled::nchwToNhwcKernel<__half, ...>``): a name that matches no pattern counts as
other work, so an unknown library's kernel is never blamed. Triton kernels (``torch.compile``) name no
dtype and are never counted as fp32 matrix work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DeviceEvent",
    "GpuActivity",
    "busy_seconds",
    "event_kind",
    "is_convolution",
    "is_fp32_matmul",
    "is_nchw_conv",
    "read_activity",
]

# Names that say a kernel works in a format other than IEEE fp32 (TF32, 16-bit, 8-bit, fp64). CUTLASS's
# fp32 tensor-op GEMMs (`cutlass_80_tensorop_s1688gemm_...`) run TF32 MMAs: tensor cores have no IEEE fp32
# mode, so "s1688"/"s16816" without "tf32" in the name is TF32 too, not what TF32 would speed up.
_NOT_FP32 = (
    "tf32", "s1688", "s16816", "tensorop", "f16", "bf16", "half", "bfloat16", "h884", "h1688", "h16816",
    "hgemm", "int8", "i8i8", "e4m3", "e5m2", "fp8", "dgemm", "f64", "double", "gemv",
)  # fmt: skip
# Names of fp32 matrix kernels that run on the CUDA cores (what TF32 moves to tensor cores): cuBLAS's
# SIMT SGEMMs (`ampere_sgemm_*`, `cutlass_80_simt_sgemm_*`, `gemmSN_*<float...>` are "sgemm"/"ffma"),
# xmma GEMMs and convolutions with fp32 inputs and fp32 math (`..._f32f32_f32f32_f32_...`, TF32 ones read
# `f32f32_tf32f32`), cuDNN's fp32 convolutions (`scudnn_*`, `implicit_convolve_sgemm<float, ...>`).
_FP32_MATRIX = ("sgemm", "ffma", "f32f32_f32f32", "scudnn")
# The transposes cuDNN puts around a convolution whose tensors are NCHW to run its NHWC tensor-core kernel.
_LAYOUT_TRANSPOSES = ("nchwtonhwc", "nhwctonchw", "nchw2nhwc", "nhwc2nchw")
_CONVOLUTION = ("conv", "fprop", "dgrad", "wgrad", "cudnn")
_REDUCED = ("f16", "bf16", "half", "bfloat16", "h884", "h1688", "h16816")


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    """One span of GPU activity: a kernel, a copy or a memset (times in microseconds, as torch.profiler's).

    ``kind`` is ``"kernel"``, ``"htod"`` (a host-to-device copy), ``"copy"`` (any other copy) or
    ``"memset"``; :func:`event_kind` derives it from the name.
    """

    name: str
    device: int
    stream: int
    start_us: float
    end_us: float
    kind: str


@dataclass(frozen=True, slots=True)
class GpuActivity:
    """One sampled step on its busiest GPU (the one with the most busy time); seconds and counts.

    Each ``*_s`` is the union of its spans (work overlapping on two streams counted once).

    Attributes:
        busy_s: kernels, copies and memsets.
        kernels: kernels run (copies and memsets not counted).
        kernel_sum_s: the kernels' durations added up (``kernel_sum_s / kernels`` is the mean kernel).
        fp32_gemm_s: fp32 matrix products run without TF32 (:func:`is_fp32_matmul`, not a convolution).
        fp32_conv_s: fp32 convolutions run without TF32 (:func:`is_fp32_matmul` and :func:`is_convolution`).
        nchw_conv_s: NCHW convolutions in 16 bits and cuDNN's layout transposes (:func:`is_nchw_conv`).
        htod_compute_s: host-to-device copies on the compute stream, the stream with the most kernel time
            (the kernels after a copy on it wait for the copy).
    """

    busy_s: float
    kernels: int
    kernel_sum_s: float
    fp32_gemm_s: float
    fp32_conv_s: float
    nchw_conv_s: float
    htod_compute_s: float

    def without_tf32_s(self, *, matmul_tf32: bool, cudnn_tf32: bool) -> float:
        """The fp32 matrix time TF32 would speed up: the products where matmuls may not use TF32, the
        convolutions where cuDNN may not (a kernel without TF32 while it was allowed is cuBLAS's or cuDNN's
        own choice, which turning TF32 on would not change)."""
        return (0.0 if matmul_tf32 else self.fp32_gemm_s) + (0.0 if cudnn_tf32 else self.fp32_conv_s)


def event_kind(name: str) -> str:
    """``"htod"``, ``"copy"``, ``"memset"`` or ``"kernel"`` for a CUDA activity named as Kineto names it
    (``"Memcpy HtoD (Pinned -> Device)"``, ``"Memcpy DtoD (Device -> Device)"``, ``"Memset (Device)"``)."""
    low = name.lower()
    if low.startswith("memcpy"):
        return "htod" if "htod" in low else "copy"
    if low.startswith("memset"):
        return "memset"
    return "kernel"


def is_fp32_matmul(name: str) -> bool:
    """Whether a kernel's name shows an fp32 GEMM or convolution on the CUDA cores (no TF32, no 16 bits).

    >>> is_fp32_matmul("ampere_sgemm_128x64_nn"), is_fp32_matmul("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n")
    (True, False)
    """
    low = name.lower()
    return any(p in low for p in _FP32_MATRIX) and not any(p in low for p in _NOT_FP32)


def is_convolution(name: str) -> bool:
    """Whether a kernel's name shows a convolution (cuDNN's, or one named conv/fprop/dgrad/wgrad)."""
    low = name.lower()
    return any(p in low for p in _CONVOLUTION)


def is_nchw_conv(name: str) -> bool:
    """Whether a kernel is one of cuDNN's NCHW/NHWC transposes, or a 16-bit convolution whose name shows
    NCHW tensors and no NHWC (channels_last would remove the first and speed up the second).

    >>> is_nchw_conv("void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true>(...)")
    True
    """
    low = name.lower()
    if any(p in low for p in _LAYOUT_TRANSPOSES):
        return True
    return "nchw" in low and "nhwc" not in low and is_convolution(low) and any(p in low for p in _REDUCED)


def busy_seconds(spans_us: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals in microseconds, in seconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans_us):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def read_activity(events: Iterable[DeviceEvent]) -> GpuActivity | None:
    """Sum up one step's GPU activity on its busiest GPU; None when there was none."""
    by_device: dict[int, list[DeviceEvent]] = {}
    for event in events:
        by_device.setdefault(event.device, []).append(event)
    if not by_device:
        return None
    busiest = max(by_device.values(), key=lambda es: busy_seconds([(e.start_us, e.end_us) for e in es]))
    kernels = [e for e in busiest if e.kind == "kernel"]
    per_stream: dict[int, list[tuple[float, float]]] = {}
    for e in kernels:
        per_stream.setdefault(e.stream, []).append((e.start_us, e.end_us))
    fp32 = [e for e in kernels if is_fp32_matmul(e.name)]
    compute = max(per_stream, key=lambda s: busy_seconds(per_stream[s])) if per_stream else None

    def union(chosen: Iterable[DeviceEvent]) -> float:
        return busy_seconds([(e.start_us, e.end_us) for e in chosen])

    return GpuActivity(
        busy_s=union(busiest),
        kernels=len(kernels),
        kernel_sum_s=sum(e.end_us - e.start_us for e in kernels) / 1e6,
        fp32_gemm_s=union(e for e in fp32 if not is_convolution(e.name)),
        fp32_conv_s=union(e for e in fp32 if is_convolution(e.name)),
        nchw_conv_s=union(e for e in kernels if is_nchw_conv(e.name)),
        htod_compute_s=union(e for e in busiest if e.kind == "htod" and e.stream == compute),
    )

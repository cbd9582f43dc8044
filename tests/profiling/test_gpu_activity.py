"""From a sampled step's GPU trace to what the advice weighs: kernel names sorted, spans summed per kind.

The names are the ones cuBLAS, cuDNN and CUTLASS kernels carry in torch.profiler traces on Ampere and Hopper
(taken from published traces); the events are synthetic records, so no GPU is needed.
"""

from __future__ import annotations

import pytest

from speedups.profiling.gpu_activity import (
    DeviceEvent,
    event_kind,
    is_convolution,
    is_fp32_matmul,
    is_nchw_conv,
    read_activity,
)

SGEMM = "ampere_sgemm_128x64_nn"
XMMA_FP32 = (
    "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize256x64x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_"
    "execute_kernel__5x_cublas"
)
XMMA_TF32 = (
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_"
    "kernel__5x_cublas"
)
FP32_CONV = "void implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false, false, true>(int, int)"
HALF_CONV_NCHW = (
    "void implicit_convolve_sgemm<__half, __half, 1024, 5, 5, 3, 3, 3, 1, false, false, true>(int)"
)
TO_NHWC = "void cudnn::engines_precompiled::nchwToNhwcKernel<float, __half, float, false, true, 0>(...)"
TO_NCHW = "void cudnn::ops::nhwcToNchwKernel<__half, __half, float, true, false, 0>(...)"
HALF_CONV_NHWC = "sm80_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x32"
HALF_CONV_NCHW_XMMA = "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nchwkcrs_nchw_tilesize128x128x32"
TF32_CONV_NCHW = "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nchwkcrs_nchw_tilesize128x128x16"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)"


@pytest.mark.parametrize(
    ("name", "fp32"),
    [
        (SGEMM, True),  # cuBLAS SIMT SGEMM: what TF32 moves to tensor cores
        (XMMA_FP32, True),  # fp32 inputs, fp32 math (ffma)
        ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>(Params)", True),
        (FP32_CONV, True),
        ("_5x_cudnn_ampere_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1", True),
        (XMMA_TF32, False),  # TF32 already
        ("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize32x32x64_stage3_warpsize2x1x2_tensor16x8x8", False),
        ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", False),  # fp32 on tensor cores is TF32
        ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", False),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", False),
        (HALF_CONV_NCHW, False),  # "sgemm" in a 16-bit convolution's name
        ("volta_dgemm_128x64_nn", False),  # fp64: TF32 does not apply
        ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false>(...)", False),
        ("triton_tem_fused_mm_0", False),  # compiled: no dtype in the name
        (ELEMENTWISE, False),
    ],
)
def test_fp32_matrix_kernels_without_tf32_are_told_by_name(name: str, fp32: bool) -> None:
    assert is_fp32_matmul(name) is fp32


def test_convolutions_are_told_from_products() -> None:
    assert [is_convolution(n) for n in (FP32_CONV, HALF_CONV_NHWC, TO_NHWC, SGEMM, XMMA_FP32)] == [
        True,
        True,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("name", "nchw"),
    [
        (TO_NHWC, True),  # the transposes cuDNN adds around an NCHW convolution
        (TO_NCHW, True),
        (HALF_CONV_NCHW_XMMA, True),  # a 16-bit convolution on NCHW tensors
        (HALF_CONV_NHWC, False),  # channels_last already
        (TF32_CONV_NCHW, False),  # fp32: not the autocast case this share weighs
        (HALF_CONV_NCHW, False),  # no layout in the name: not blamed
        (SGEMM, False),
        (ELEMENTWISE, False),
    ],
)
def test_nchw_convolutions_and_their_transposes_are_told_by_name(name: str, nchw: bool) -> None:
    assert is_nchw_conv(name) is nchw


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("Memcpy HtoD (Pinned -> Device)", "htod"),
        ("Memcpy HtoD (Pageable -> Device)", "htod"),
        ("Memcpy DtoH (Device -> Pageable)", "copy"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("Memset (Device)", "memset"),
        (SGEMM, "kernel"),
    ],
)
def test_event_kinds_follow_kinetos_names(name: str, kind: str) -> None:
    assert event_kind(name) == kind


def ev(name: str, start: float, end: float, *, stream: int = 7, device: int = 0) -> DeviceEvent:
    return DeviceEvent(name, device, stream, start, end, event_kind(name))


def test_a_trace_is_summed_per_kind_on_the_busiest_gpu() -> None:
    """Times in microseconds. Stream 7 runs the most kernel time (the compute stream), stream 20 is a side
    stream; cuda:1 is less busy and left out."""
    trace = [
        ev("Memcpy HtoD (Pinned -> Device)", 0, 40, stream=20),  # on a side stream: overlaps, not counted
        ev(SGEMM, 0, 100),
        ev(XMMA_FP32, 50, 130, stream=21),  # overlaps the SGEMM by 50: the union counts it once
        ev(FP32_CONV, 130, 150),
        ev(XMMA_TF32, 150, 200),
        ev(TO_NHWC, 200, 210),
        ev(HALF_CONV_NHWC, 210, 260),
        ev(TO_NCHW, 260, 270),
        ev("Memcpy HtoD (Pageable -> Device)", 270, 300),  # on the compute stream: the kernels wait
        ev("Memset (Device)", 300, 302),
        ev("Memcpy DtoH (Device -> Pageable)", 302, 310),
        ev(ELEMENTWISE, 400, 405),
        ev(SGEMM, 0, 250, device=1),
    ]
    activity = read_activity(trace)
    assert activity is not None
    assert activity.busy_s == pytest.approx(315e-6)  # 0-310 and 400-405
    assert activity.kernels == 8
    assert activity.kernel_sum_s == pytest.approx((100 + 80 + 20 + 50 + 10 + 50 + 10 + 5) * 1e-6)
    assert activity.fp32_gemm_s == pytest.approx(130e-6)  # SGEMM and fp32 xmma, overlap once
    assert activity.fp32_conv_s == pytest.approx(20e-6)
    assert activity.nchw_conv_s == pytest.approx(20e-6)  # the two transposes; the NHWC convolution not
    assert activity.htod_compute_s == pytest.approx(30e-6)
    # TF32 would speed up only what it was off for
    assert activity.without_tf32_s(matmul_tf32=False, cudnn_tf32=False) == pytest.approx(150e-6)
    assert activity.without_tf32_s(matmul_tf32=False, cudnn_tf32=True) == pytest.approx(130e-6)
    assert activity.without_tf32_s(matmul_tf32=True, cudnn_tf32=False) == pytest.approx(20e-6)
    assert activity.without_tf32_s(matmul_tf32=True, cudnn_tf32=True) == 0.0


def test_copies_on_a_side_stream_are_not_counted_and_the_compute_stream_is_the_busiest() -> None:
    """A prefetching loop: copies on stream 20 while stream 7 computes; a tiny kernel on stream 20 does not
    make it the compute stream."""
    trace = [
        ev(SGEMM, 0, 500, stream=7),
        ev("Memcpy HtoD (Pinned -> Device)", 0, 200, stream=20),
        ev(ELEMENTWISE, 200, 202, stream=20),
    ]
    activity = read_activity(trace)
    assert activity is not None and activity.htod_compute_s == 0.0 and activity.kernels == 2


def test_no_activity_reads_none_and_copies_alone_have_no_compute_stream() -> None:
    assert read_activity([]) is None
    copies_only = read_activity([ev("Memcpy HtoD (Pinned -> Device)", 0, 100)])
    assert copies_only is not None
    assert (copies_only.busy_s, copies_only.kernels, copies_only.htod_compute_s) == (
        pytest.approx(1e-4),
        0,
        0,
    )

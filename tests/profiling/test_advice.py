"""The advice rules: each fires on the loop that triggers it, most valuable first; none on a clean loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import speedups.profiling.measure as _measure
import speedups.profiling.profiler as profiler
from speedups import LossTracker, profile_steps
from speedups.profiling.advice import (
    HTOD_SHARE,
    LAUNCH_HOST_S,
    LAUNCH_KERNELS,
    NCHW_SHARE,
    TF32_SHARE,
    Summary,
    advise,
)
from tests._profiling_loops import SlowDataset, WorkClock, busy_step


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def rules_fired(prof) -> set[str]:
    return {a.rule for a in prof.advice()}


@pytest.fixture
def work_clock(monkeypatch) -> WorkClock:
    """The profiler's clock moves by the work charged to it only: the rules see the times the test says."""
    clock = WorkClock()
    monkeypatch.setattr(profiler, "time", clock)
    return clock


def test_data_bound_and_num_workers_rules_fire_on_a_slow_loader(model, monkeypatch, work_clock) -> None:
    monkeypatch.setattr(profiler, "usable_cpus", lambda: 4)
    loader = DataLoader(SlowDataset(40, 0.002, work_clock), batch_size=4, num_workers=0)  # 8 ms data a step
    with profile_steps() as prof:
        for x, _ in prof.iter(loader):
            busy_step(model, x, ms=1, clock=work_clock)
    assert prof.summary().data_fraction == pytest.approx(8 / 9)
    fired = rules_fired(prof)
    assert {"data-bound", "num-workers-0"} <= fired
    assert prof.advice()[0].rule == "data-bound"  # most valuable first
    text = str(prof.report())
    assert "waits for data" in text and "fast_loader" in text and "tune_loader" in text


def test_clean_loop_gets_no_advice(model, monkeypatch, work_clock) -> None:
    """A batch from a list costs no time, a step 3 ms: no wait for data (on the wall clock, a moment of
    another process's work during one fetch made it look data-bound on a loaded machine)."""
    monkeypatch.setattr(profiler, "usable_cpus", lambda: 4)
    batches = [torch.randn(16, 8) for _ in range(20)]
    tracker = LossTracker()
    with profile_steps(sample_every=5) as prof:
        for x in prof.iter(batches):
            tracker.update(busy_step(model, x, ms=3, clock=work_clock))
    assert prof.advice() == []
    assert "No tip applies" in str(prof.report())


def test_sync_bound_rule_fires_on_item_every_step(model, monkeypatch) -> None:
    """Reads of device tensors count; here the CPU stands in for the device (see the cuda test below)."""
    monkeypatch.setattr(_measure, "reads_the_device", lambda t: isinstance(t, torch.Tensor))
    batches = [torch.randn(16, 8) for _ in range(12)]
    losses = []
    with profile_steps(sample_every=3) as prof:
        for x in prof.iter(batches):
            losses.append(busy_step(model, x, ms=1).item())  # a sync every step
    s = prof.summary()
    assert s.syncs_per_step == pytest.approx(1.0) and s.sampled_steps == 4
    assert "sync-bound" in rules_fired(prof)
    assert "LossTracker" in str(prof.report())


def test_reads_of_cpu_tensors_are_not_syncs_and_a_cpu_run_gets_no_sync_advice(model) -> None:
    """Adam's CPU step counter, a PackedSequence's batch_sizes and .item() on the CPU wait for no device."""
    opt = torch.optim.Adam(model.parameters())
    batches = [torch.randn(16, 8) for _ in range(12)]
    with profile_steps(sample_every=3) as prof:
        for x in prof.iter(batches):
            opt.zero_grad()
            busy_step(model, x, ms=1).item()
            opt.step()  # reads its CPU step counter with .item()
            packed = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
            packed.batch_sizes.tolist()
    s = prof.summary()
    assert s.syncs_per_step == 0.0 and s.sampled_steps == 4
    assert "sync-bound" not in rules_fired(prof)


@pytest.mark.cuda
def test_sync_bound_rule_fires_on_a_gpu_item_every_step() -> None:
    model = nn.Linear(8, 4).cuda()
    opt = torch.optim.Adam(model.parameters())  # its step counter stays on the CPU: not a sync
    with profile_steps(sample_every=3) as prof:
        for x in prof.iter([torch.randn(16, 8, device="cuda") for _ in range(12)]):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()
    assert prof.summary().syncs_per_step == pytest.approx(1.0)
    assert "sync-bound" in rules_fired(prof)


def test_cpu_bf16_rule_fires_only_without_native_bf16(model, monkeypatch) -> None:
    batches = [torch.randn(4, 8) for _ in range(3)]
    with profile_steps(warmup=0, sample_every=1) as prof:
        for x in prof.iter(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
    assert prof.summary().cpu_bf16_matmuls >= 3
    monkeypatch.setattr(profiler, "cpu_has_native_bf16", lambda: False)
    assert "cpu-bf16" in rules_fired(prof)
    assert "mixed_precision('auto')" in str(prof.report())
    monkeypatch.setattr(profiler, "cpu_has_native_bf16", lambda: True)
    assert "cpu-bf16" not in rules_fired(prof)

    with profile_steps(warmup=0, sample_every=1) as clean:  # fp32: silent even without native bf16
        for x in clean.iter(batches):
            model(x).sum().backward()
    monkeypatch.setattr(profiler, "cpu_has_native_bf16", lambda: False)
    assert clean.summary().cpu_bf16_matmuls == 0 and "cpu-bf16" not in rules_fired(clean)


BASE = Summary(
    steps=50, mean_data_s=0.001, mean_step_s=0.010, data_fraction=0.09, syncs_per_step=0.0, sampled_steps=2,
    samples_per_s=3000.0, mean_batch=32.0, device_type="cuda", device_busy_fraction=0.9,
    cache_frees_per_step=0.0, cpu_bf16_matmuls=0, native_cpu_bf16=False, loader_workers=4, usable_cpus=8,
    peak_memory="",
)  # fmt: skip


def test_gpu_rules_on_their_summaries() -> None:
    """empty_cache and tiny batches need a GPU to trigger for real (see the cuda tests); the rules
    themselves are checked on the summaries such loops produce."""
    assert advise(BASE) == []
    empty_cache = advise(dataclasses.replace(BASE, cache_frees_per_step=6.0))
    assert [a.rule for a in empty_cache] == ["empty-cache"] and "empty_cache()" in empty_cache[0].message
    tiny = advise(dataclasses.replace(BASE, device_busy_fraction=0.2, mean_batch=4.0))
    assert [a.rule for a in tiny] == ["tiny-batches"] and "find_batch_size" in tiny[0].fix
    assert tiny[0].value == pytest.approx(0.8)
    # tiny batches is not the diagnosis when the loop is starved of data, nor on a CPU
    starved = dataclasses.replace(BASE, device_busy_fraction=0.2, data_fraction=0.5)
    assert "tiny-batches" not in {a.rule for a in advise(starved)}
    assert advise(dataclasses.replace(BASE, device_type="cpu", device_busy_fraction=None)) == []


@pytest.mark.cuda
def test_empty_cache_and_tiny_batches_fire_on_a_gpu_loop() -> None:
    model = nn.Linear(64, 64).cuda()
    batches = [torch.randn(2, 64, device="cuda") for _ in range(30)]
    with profile_steps(sample_every=2) as prof:
        for x in prof.iter(batches):
            big = torch.empty(64 * 2**20, device="cuda")  # 256 MiB, cached then released
            del big
            model(x).sum().backward()
            torch.cuda.empty_cache()
    assert {"empty-cache", "tiny-batches"} <= rules_fired(prof)


# ------------------------------------------------------------------------ rules read from the GPU trace
# A traced GPU loop with nothing to fix: 40 kernels of 150 µs a step, busy 90%, TF32 tensor cores present.
TRACED = dataclasses.replace(
    BASE, gpu_kernels_per_step=40.0, mean_kernel_s=150e-6, fp32_matmul_fraction=0.0, nchw_conv_fraction=0.0,
    htod_compute_fraction=0.0, tf32_capable=True,
)  # fmt: skip


def rules(summary: Summary) -> list[str]:
    return [a.rule for a in advise(summary)]


def test_a_traced_gpu_loop_with_nothing_to_fix_gets_no_advice() -> None:
    assert advise(TRACED) == []


@pytest.mark.parametrize(
    ("field", "threshold", "rule", "fix"),
    [
        ("fp32_matmul_fraction", TF32_SHARE, "tf32-off", "fast_kernels(model)"),
        ("nchw_conv_fraction", NCHW_SHARE, "nchw-convolutions", "fast_kernels(model)"),
        ("htod_compute_fraction", HTOD_SHARE, "copies-on-compute-stream", "prefetch_to_device(loader)"),
    ],
)
def test_each_share_rule_fires_from_its_threshold_with_the_measured_share_and_the_fix(
    field: str, threshold: float, rule: str, fix: str
) -> None:
    at = advise(dataclasses.replace(TRACED, **{field: threshold}))
    assert [a.rule for a in at] == [rule] and at[0].value == threshold and fix in at[0].fix
    assert at[0].message.startswith(f"{threshold:.0%} of each step")
    measured = advise(dataclasses.replace(TRACED, **{field: 0.37}))
    assert measured[0].value == 0.37 and measured[0].message.startswith("37% of each step")
    assert fix in str(measured[0])  # the report's line shows the fix
    assert rules(dataclasses.replace(TRACED, **{field: threshold - 0.001})) == []  # just below
    assert rules(dataclasses.replace(TRACED, **{field: None})) == []  # not traced
    assert rules(dataclasses.replace(TRACED, device_type="cpu", **{field: 0.37})) == []


def test_tf32_advice_needs_tf32_tensor_cores_and_names_both_fixes() -> None:
    off = dataclasses.replace(TRACED, fp32_matmul_fraction=0.6)
    (advice,) = advise(off)
    assert "TF32 off" in advice.message and "compute capability 8.0" in advice.message
    assert "fast_kernels(model)" in advice.fix and "mixed_precision()" in advice.fix
    assert rules(dataclasses.replace(off, tf32_capable=False)) == []  # before Ampere: nothing to turn on
    assert rules(dataclasses.replace(off, tf32_capable=None)) == []


def test_nchw_advice_names_channels_last() -> None:
    (advice,) = advise(dataclasses.replace(TRACED, nchw_conv_fraction=0.25))
    assert "NCHW" in advice.message and "nchwToNhwc" in advice.message
    assert "channels_last" in advice.fix


# Launch-bound: busy 20%, 400 kernels of 3 µs launched 10 µs apart (a 4 ms step of eager PyTorch ops).
LAUNCH = dataclasses.replace(
    TRACED, mean_step_s=0.004, device_busy_fraction=0.2, gpu_kernels_per_step=400.0, mean_kernel_s=3e-6
)


def test_launch_bound_is_said_instead_of_tiny_batches_with_cuda_graphs_as_code() -> None:
    (advice,) = advise(LAUNCH)
    assert advice.rule == "launch-bound" and advice.value == pytest.approx(0.8)  # the idle share
    assert advice.message.startswith(
        "The GPU is idle 80% of each step between 400 short kernels (3.0 µs each"
    )
    assert "10 µs apart" in advice.message and "find_batch_size" in advice.message  # the other fix, said once
    assert 'torch.compile(model, mode="reduce-overhead")' in advice.fix
    assert 'compile_blocks(model, "blocks.*", mode="reduce-overhead")' in advice.fix


def test_launch_bound_boundaries_and_what_tiny_batches_keeps() -> None:
    n = 16.0  # a power of two: n * LAUNCH_HOST_S / n is exactly LAUNCH_HOST_S
    at_limits = dataclasses.replace(LAUNCH, gpu_kernels_per_step=n, mean_step_s=n * LAUNCH_HOST_S)
    assert rules(at_limits) == ["launch-bound"]
    ten = dataclasses.replace(LAUNCH, gpu_kernels_per_step=float(LAUNCH_KERNELS), mean_step_s=0.0005)
    assert rules(ten) == ["launch-bound"]
    # just past each limit the idle GPU is tiny batches' (other host work, or too few kernels to replay)
    slower_host = dataclasses.replace(at_limits, mean_step_s=n * LAUNCH_HOST_S * 1.01)
    assert rules(slower_host) == ["tiny-batches"]
    assert rules(dataclasses.replace(ten, gpu_kernels_per_step=LAUNCH_KERNELS - 1.0)) == ["tiny-batches"]
    assert rules(dataclasses.replace(LAUNCH, gpu_kernels_per_step=None)) == ["tiny-batches"]  # no trace
    # neither when the GPU is busy half the step, nor when the step waits for data (that is data-bound)
    assert rules(dataclasses.replace(LAUNCH, device_busy_fraction=0.5)) == []
    assert rules(dataclasses.replace(LAUNCH, device_busy_fraction=0.49)) == ["launch-bound"]
    starved = rules(dataclasses.replace(LAUNCH, data_fraction=0.2))
    assert "launch-bound" not in starved and "tiny-batches" not in starved and "data-bound" in starved


def test_the_gpu_rules_are_ordered_by_their_shares() -> None:
    everything = dataclasses.replace(
        LAUNCH, fp32_matmul_fraction=0.15, nchw_conv_fraction=0.12, htod_compute_fraction=0.3
    )
    assert rules(everything) == ["launch-bound", "copies-on-compute-stream", "tf32-off", "nchw-convolutions"]


@pytest.mark.cuda
def test_tf32_advice_fires_on_a_gpu_fp32_matmul_loop_with_tf32_off_and_not_with_it_on() -> None:
    """On a real GPU: an fp32 Linear training loop with TF32 off gets the TF32 advice, its share read from
    cuBLAS's kernel names; with fast_kernels() on, the same loop does not."""
    from speedups import fast_kernels
    from speedups.kernels import tf32

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs a GPU of compute capability 8.0 or later")
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    before = matmul.fp32_precision if new_api else torch.get_float32_matmul_precision()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048)).cuda()
    batches = [torch.randn(4096, 2048, device="cuda") for _ in range(8)]

    def run():
        with profile_steps(sample_every=3) as prof:
            for x in prof.iter(batches):
                model(x).square().mean().backward()
        return prof

    try:
        if new_api:
            matmul.fp32_precision = "ieee"
        else:
            torch.set_float32_matmul_precision("highest")
        assert not tf32.matmul_allowed()
        off = run()
    finally:
        if new_api:
            matmul.fp32_precision = before
        else:
            torch.set_float32_matmul_precision(before)
    s = off.summary()
    assert s.tf32_capable is True and s.gpu_kernels_per_step
    advice = {a.rule: a for a in off.advice()}
    assert "tf32-off" in advice, f"no TF32 advice: fp32 share {s.fp32_matmul_fraction}\n{off.report()}"
    assert advice["tf32-off"].value > 0.5 and "fast_kernels(model)" in advice["tf32-off"].fix
    with fast_kernels(model, cudnn_benchmark=False, channels_last=False):
        on = run()
    assert on.summary().fp32_matmul_fraction == 0.0
    assert "tf32-off" not in {a.rule for a in on.advice()}


@pytest.mark.cuda
def test_launch_bound_fires_on_a_gpu_loop_of_many_tiny_layers() -> None:
    """50 tiny layers on a batch of 8: hundreds of microsecond kernels a step, each launched by eager
    PyTorch; the GPU waits for the launches, and the advice is CUDA graphs, not tiny batches."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(50)]).cuda()
    with profile_steps(sample_every=5) as prof:
        for x in prof.iter([torch.randn(8, 32, device="cuda") for _ in range(30)]):
            model(x).sum().backward()
    s = prof.summary()
    assert s.gpu_kernels_per_step is not None and s.gpu_kernels_per_step >= 150, s
    fired = rules_fired(prof)
    assert "launch-bound" in fired and "tiny-batches" not in fired, prof.report()


@pytest.mark.cuda
def test_pageable_copies_in_the_step_are_copies_on_the_compute_stream() -> None:
    """Each step copies a 64 MiB batch from pageable host memory on the stream the model runs on."""
    model = nn.Linear(1024, 16).cuda()
    batches = [torch.randn(16384, 1024) for _ in range(8)]  # on the host, not pinned
    with profile_steps(sample_every=3) as prof:
        for x in prof.iter(batches):
            model(x.to("cuda")).sum().backward()
    s = prof.summary()
    assert s.htod_compute_fraction is not None and s.htod_compute_fraction >= HTOD_SHARE, prof.report()
    assert "copies-on-compute-stream" in rules_fired(prof)


# --------------------------------------------------------------- fp32 matrix work on a native-bf16 CPU
def test_matmul_flops_counts_each_call_from_its_shapes() -> None:
    x, w = torch.randn(5, 7), torch.randn(3, 7)
    assert _measure.matmul_flops("linear", (x, w), torch.empty(5, 3)) == 2 * 5 * 3 * 7
    assert _measure.matmul_flops("mm", (x, w.T), torch.empty(5, 3)) == 2 * 5 * 3 * 7
    a, b = torch.randn(2, 5, 7), torch.randn(2, 7, 3)
    assert _measure.matmul_flops("bmm", (a, b), torch.empty(2, 5, 3)) == 2 * 2 * 5 * 3 * 7
    assert _measure.matmul_flops("addmm", (torch.zeros(3), x, w.T), torch.empty(5, 3)) == 2 * 5 * 3 * 7
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 32, 8)  # 16 queries, 32 keys, heads 8 wide
    assert _measure.matmul_flops("scaled_dot_product_attention", (q, k, k), q) == 4 * 2 * 4 * 16 * 32 * 8
    needs_grad = torch.empty(5, 3, requires_grad=True)  # forward and the backward's two products
    assert _measure.matmul_flops("linear", (x, w), needs_grad) == 3 * 2 * 5 * 3 * 7
    assert _measure.matmul_flops("einsum", ("ij,jk", x, w.T), torch.empty(5, 3)) == 0
    assert _measure.matmul_flops("linear", (x,), torch.empty(5, 3)) == 0  # malformed: not counted


def test_cpu_fp32_rule_fires_on_an_fp32_step_of_a_native_bf16_cpu(monkeypatch) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    batches = [torch.randn(32, 64) for _ in range(4)]
    monkeypatch.setattr(profiler, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(
        profiler, "cpu_fp32_matmul_rate", lambda: 1.0
    )  # 1 FLOP/s: any share is the whole step

    def run(autocast: bool):
        with profile_steps(warmup=0, sample_every=1) as prof:
            for x in prof.iter(batches):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = mlp(x)
                out.float().sum().backward()
        return prof

    fp32 = run(False)
    sampled = [r for r in fp32.steps if r.syncs is not None]
    # each sampled step: two Linear layers, forward and backward (x3), counted from the shapes
    assert sampled and all(r.cpu_fp32_matmul_flops == 3 * 2 * 32 * (64 * 128 + 128 * 10) for r in sampled)
    summary = fp32.summary()
    assert summary.cpu_fp32_matmul_share == 1.0
    advice = {a.rule: a for a in fp32.advice()}
    assert advice["cpu-fp32-matmul"].value == pytest.approx(0.5)
    assert "@mixed_precision()" in advice["cpu-fp32-matmul"].fix and "100% of the step" in str(fp32.report())

    bf16 = run(True)  # the step already runs its products in bf16: nothing to advise
    assert bf16.summary().cpu_fp32_matmul_share is None and "cpu-fp32-matmul" not in rules_fired(bf16)
    with profile_steps(warmup=0, sample_every=1) as mixed:  # autocast on, one product kept in fp32 on purpose
        for x in mixed.iter(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = mlp[1](mlp[0](x))
            mlp[2](hidden.float()).sum().backward()
    assert any(r.cpu_fp32_matmul_flops for r in mixed.steps) and any(r.cpu_bf16_matmuls for r in mixed.steps)
    assert mixed.summary().cpu_fp32_matmul_share is None and "cpu-fp32-matmul" not in rules_fired(mixed)
    monkeypatch.setattr(profiler, "cpu_has_native_bf16", lambda: False)  # bf16 emulated: fp32 is right
    assert fp32.summary().cpu_fp32_matmul_share is None and "cpu-fp32-matmul" not in rules_fired(fp32)


def test_cpu_fp32_rule_needs_half_the_step_on_a_cpu() -> None:
    from speedups.profiling.advice import CPU_FP32_SHARE

    cpu = dataclasses.replace(BASE, device_type="cpu", device_busy_fraction=None)
    assert advise(dataclasses.replace(cpu, cpu_fp32_matmul_share=None)) == []
    assert advise(dataclasses.replace(cpu, cpu_fp32_matmul_share=CPU_FP32_SHARE - 0.01)) == []
    fired = advise(dataclasses.replace(cpu, cpu_fp32_matmul_share=0.6))
    assert [a.rule for a in fired] == ["cpu-fp32-matmul"] and fired[0].value == pytest.approx(0.3)
    assert "60% of the step" in fired[0].message
    assert advise(dataclasses.replace(BASE, cpu_fp32_matmul_share=0.6)) == []  # a CUDA step: the TF32 rule's


def test_the_matmul_rate_draws_no_random_numbers() -> None:
    from speedups._helpers.hardware import cpu_fp32_matmul_rate

    cpu_fp32_matmul_rate.cache_clear()
    state = torch.get_rng_state()
    assert cpu_fp32_matmul_rate() > 0
    assert torch.equal(torch.get_rng_state(), state)

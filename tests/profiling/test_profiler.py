"""profile_steps: timing, sampled sync counts, the decorator, bad input, enabled=False, and the plot."""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.overrides import has_torch_function
from torch.utils.data import DataLoader

import speedups.profiling.profiler as profiler_module
from speedups import SpeedupsError, profile_steps
from speedups.profiling.gpu_activity import busy_seconds
from tests._profiling_loops import SlowDataset, busy_step


def test_times_add_up_and_batch_sizes_are_read(model, monkeypatch) -> None:
    # the profiler's clock advanced by hand (1 ms per batch fetched, 3 ms per step): load cannot stretch it,
    # so each wait and each step is attributed exactly
    clock = [100.0]
    monkeypatch.setattr(profiler_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def loader() -> Iterator[torch.Tensor]:
        for _ in range(6):
            clock[0] += 0.001
            yield torch.randn(16, 8)

    with profile_steps(warmup=0, sample_every=1000) as prof:
        for x in prof.iter(loader()):
            model(x).pow(2).mean().backward()
            clock[0] += 0.003
    assert len(prof.steps) == 6
    assert all(r.samples == 16 for r in prof.steps)
    timed = [r for r in prof.steps if not r.sampled]
    assert all(r.step_s == pytest.approx(0.003, abs=1e-9) for r in timed)
    assert all(r.data_s == pytest.approx(0.001, abs=1e-9) for r in timed)
    s = prof.summary()
    assert s.mean_step_s == pytest.approx(sum(r.step_s for r in timed) / len(timed))
    assert s.samples_per_s == pytest.approx(16 / (s.mean_data_s + s.mean_step_s))


def test_breaking_out_of_the_loop_closes_the_step(model) -> None:
    with profile_steps(warmup=0, sample_every=1) as prof:
        for i, _x in enumerate(prof.iter([torch.randn(2, 8)] * 5)):
            if i == 2:
                break
    assert len(prof.steps) == 3 and prof.steps[-1].syncs == 0
    # the sync-counting mode was popped: no TorchFunctionMode is left active
    assert not has_torch_function((torch.ones(()),))


def test_decorator_records_each_call_and_takes_the_data_wait_from_iter(model) -> None:
    prof = profile_steps(warmup=0, sample_every=1000)

    @prof
    def train_step(x: torch.Tensor) -> torch.Tensor:
        return busy_step(model, x, ms=2)

    loader = DataLoader(SlowDataset(12, 0.002), batch_size=4)
    with prof:
        for x, _ in prof.iter(loader):
            train_step(x)
    assert len(prof.steps) == 3
    assert all(r.data_s >= 4 * 0.002 * 0.9 for r in prof.steps)  # 4 items of 2 ms each
    assert all(r.step_s >= 0.002 for r in prof.steps)
    assert train_step.profiler is prof


def test_bare_decorator_on_function_and_method(model) -> None:
    @profile_steps
    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    for _ in range(3):
        step(torch.randn(5, 8))
    assert len(step.profiler.steps) == 3 and step.profiler.steps[0].samples == 5

    prof = profile_steps()

    class Trainer:
        @prof
        def step(self, x: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

    Trainer().step(torch.randn(3, 8))
    assert len(prof.steps) == 1 and prof.steps[0].samples == 3


@pytest.mark.cuda
def test_sync_counting_on_gpu_uses_sync_debug_mode() -> None:
    model = nn.Linear(64, 64).cuda()
    with profile_steps(sample_every=1) as prof:
        for x in prof.iter([torch.randn(8, 64, device="cuda") for _ in range(4)]):
            model(x).sum().item()
    assert prof.summary().syncs_per_step >= 1
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.cuda
def test_gpu_busy_time_is_the_kernels_time_not_the_steps_span() -> None:
    """A step of large matrix products keeps the GPU busy; a step of Python work around one tiny kernel
    leaves it idle, though CUDA events around either step span the whole step."""
    big = torch.randn(8192, 8192, device="cuda")
    with profile_steps(sample_every=2) as heavy:
        for _ in heavy.iter(range(7)):
            for _ in range(4):
                big = (big @ big).tanh_()
    small = torch.randn(4, 4, device="cuda")
    with profile_steps(sample_every=2) as idle:
        for _ in idle.iter(range(7)):
            (small @ small).sum()
            end = time.perf_counter() + 0.005
            while time.perf_counter() < end:  # 5 ms of host work, the GPU waiting
                pass
    busy, starved = heavy.summary().device_busy_fraction, idle.summary().device_busy_fraction
    assert busy is not None and busy > 0.8, busy
    assert starved is not None and starved < 0.05, starved
    assert all(r.kernel_s is not None for r in idle.steps if r.sampled)


# ------------------------------------------------------------------------------------------- bad input
def test_bad_input() -> None:
    prof = profile_steps()
    with pytest.raises(TypeError, match=r"iter\(42\).*expected an iterable"):
        prof.iter(42)
    with pytest.raises(SpeedupsError, match="no step was recorded yet"):
        prof.report()
    with pytest.raises(ValueError, match=r"warmup=-1"):
        profile_steps(warmup=-1)
    with pytest.raises(ValueError, match=r"sample_every=0"):
        profile_steps(sample_every=0)
    with pytest.raises(TypeError, match="model="):
        profile_steps(model="net")
    with pytest.raises(TypeError, match="not a class"):
        profile_steps()(type("Net", (), {}))


def test_flags_are_checked() -> None:
    with pytest.raises(TypeError, match=r"enabled='no'"):
        profile_steps(enabled="no")
    with pytest.raises(TypeError, match=r"debug='yes'"):
        profile_steps(debug="yes")


def test_enabled_false_is_a_no_op(model) -> None:
    prof = profile_steps(enabled=False)

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    assert prof(step) is step
    data = [torch.ones(2, 8)]
    assert list(prof.iter(data)) == data and prof.steps == []
    with pytest.raises(SpeedupsError, match="disabled"):
        prof.report()


# ------------------------------------------------------------------------------------------------ plot
def test_plot_writes_a_png_and_explains_a_missing_matplotlib(model, tmp_path, monkeypatch) -> None:
    with profile_steps(sample_every=2) as prof:
        for x in prof.iter([torch.randn(4, 8) for _ in range(6)]):
            busy_step(model, x, ms=1)
    path = prof.plot(tmp_path / "steps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'speedups\[examples\]'"):
        prof.plot(tmp_path / "again.png")


def test_plot_leaves_the_matplotlib_backend_alone(model, tmp_path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's backend that is not Agg: plot() must not switch it
    try:
        with profile_steps(warmup=0) as prof:
            for x in prof.iter([torch.randn(4, 8) for _ in range(3)]):
                busy_step(model, x, ms=1)
        path = prof.plot(tmp_path / "steps.png")
        assert matplotlib.get_backend() == "svg"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        matplotlib.use(before)


# ------------------------------------------------------------------------ samples per step, spread, re-entry
class _SequenceFirst(torch.utils.data.Dataset):
    """Items of shape (time=7, features=8); the collate stacks them sequence-first: (7, batch, 8)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((7, 8), float(i))


def _time_major(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(items, dim=1)


def test_samples_come_from_the_loaders_batch_size_not_dim_0() -> None:
    loader = DataLoader(_SequenceFirst(), batch_size=4, collate_fn=_time_major)
    assert next(iter(loader)).shape == (7, 4, 8)  # dim 0 is time
    with profile_steps(warmup=0) as prof:
        for _ in range(2):  # two passes: the short last batch of each is 2
            for x in prof.iter(loader):
                x.sum()
    assert [r.samples for r in prof.steps] == [4, 4, 2, 4, 4, 2]
    dropped = DataLoader(_SequenceFirst(), batch_size=4, collate_fn=_time_major, drop_last=True)
    with profile_steps(warmup=0) as prof:
        for x in prof.iter(dropped):
            x.sum()
    assert [r.samples for r in prof.steps] == [4, 4]


def test_batch_size_argument_wins_for_plain_iterables_and_the_decorator(model) -> None:
    batches = [torch.randn(7, 3, 8) for _ in range(3)]  # time-major, 3 samples each
    with profile_steps(warmup=0, batch_size=3) as prof:
        for x in prof.iter(batches):
            model(x).sum()
    assert [r.samples for r in prof.steps] == [3, 3, 3]
    step = profile_steps(batch_size=3)(lambda x: model(x).sum())
    step(batches[0])
    assert step.profiler.steps[0].samples == 3
    with pytest.raises(ValueError, match=r"profile_steps\(batch_size=0\).*batch_size"):
        profile_steps(batch_size=0)


def test_report_shows_median_and_p90_beside_the_mean(model, monkeypatch) -> None:
    clock = [100.0]  # the profiler's clock advanced by hand: load cannot reorder the steps' times
    monkeypatch.setattr(profiler_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    with profile_steps(warmup=0, sample_every=1000) as prof:
        for i, x in enumerate(prof.iter([torch.randn(4, 8)] * 12)):
            model(x).pow(2).mean().backward()
            clock[0] += (
                0.008 if i == 11 else 0.001 + i * 1e-5
            )  # one slow step: the mean moves, the median not
    s = prof.summary()
    timed = sorted(r.step_s for r in prof.steps if not r.sampled)
    n = len(timed)
    median = (timed[(n - 1) // 2] + timed[n // 2]) / 2
    rank = 0.9 * (n - 1)  # numpy's default (linear) percentile
    p90 = timed[int(rank)] + (timed[min(int(rank) + 1, n - 1)] - timed[int(rank)]) * (rank - int(rank))
    assert s.median_step_s == pytest.approx(median, rel=1e-9)
    assert s.p90_step_s == pytest.approx(p90, rel=1e-9)
    assert s.median_step_s < s.mean_step_s  # the slow step pulls the mean only
    text = str(prof.report())
    assert f"median {s.median_step_s * 1e3:.3f}  p90 {s.p90_step_s * 1e3:.3f}" in text


def test_entering_a_profiler_twice_is_refused() -> None:
    prof = profile_steps()
    with prof, pytest.raises(SpeedupsError, match=r"already entered.*profile_steps\(\) as prof"):
        prof.__enter__()
    with prof:  # after the block closed, it can be entered again
        pass


# ---------------------------------------------------------------------------- GPUs other than the current one
class _FakeCuda:
    """Two GPUs with a model on cuda:1 only, cuda:0 current (stood in: events record their stream's device
    and give a span per device; memory statistics per device)."""

    def __init__(self, monkeypatch, trace=None, capability=(9, 0)) -> None:
        self.spans_ms = {0: 0.0, 1: 7.0}
        self.recorded: list[int] = []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.device: int | None = None

            def record(self, stream=None) -> None:
                self.device = stream[1]  # type: ignore[index]
                fake.recorded.append(self.device)

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: Event) -> float:
                assert end.device == self.device
                return fake.spans_ms[self.device]  # type: ignore[index]

        for name, value in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "device_count": lambda: 2,
            "current_device": lambda: 0,
            "current_stream": lambda index=None: ("stream", 0 if index is None else index),
            "Event": Event,
            "memory_allocated": lambda index=None: 2**20 if index == 1 else 0,
            "max_memory_allocated": lambda index=None: 300 * 2**20 if index == 1 else 0,
            "memory_stats": lambda index=None: {"num_device_free": 5 if index == 1 else 0},
            "get_sync_debug_mode": lambda: 0,
            "get_device_capability": lambda index=None: capability,
            "set_sync_debug_mode": lambda mode: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

        # the GPU activity torch.profiler traces on a sampled step (name, type, device, stream, start and end
        # in µs); by default cuda:1 busy 0.4 ms of its kernels' union (two overlap), cuda:0 0.05 ms, a CPU
        # event beside them
        self.traced = 0
        cuda_type, cpu_type = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
        sgemm = "ampere_sgemm_128x64_nn"
        kernels = [(sgemm, cuda_type, 1, 7, 0.0, 200.0), (sgemm, cuda_type, 1, 7, 100.0, 300.0)]
        kernels += [(sgemm, cuda_type, 1, 7, 500.0, 600.0), (sgemm, cuda_type, 0, 7, 0.0, 50.0)]
        kernels += [("aten::mm", cpu_type, 0, 0, 0.0, 90000.0)]
        if trace is not None:
            kernels = [(name, cuda_type, device, stream, a, b) for name, device, stream, a, b in trace]

        class Profile:
            def __init__(self, activities: list) -> None:
                assert activities == [torch.profiler.ProfilerActivity.CUDA]

            def start(self) -> None:
                fake.traced += 1

            def stop(self) -> None:
                pass

            def events(self) -> list:
                return [
                    types.SimpleNamespace(
                        name=name,
                        device_type=kind,
                        device_index=index,
                        device_resource_id=stream,
                        time_range=types.SimpleNamespace(start=a, end=b),
                    )
                    for name, kind, index, stream, a, b in kernels
                ]

        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        monkeypatch.setattr(torch.profiler, "supported_activities", lambda: set(activities))
        monkeypatch.setattr(torch.profiler, "profile", Profile)


def test_gpu_time_and_memory_come_from_the_gpu_the_model_is_on_not_the_current_one(
    monkeypatch, model
) -> None:
    gpu = _FakeCuda(monkeypatch)
    with profile_steps(warmup=0, sample_every=2) as prof:
        for x in prof.iter([torch.randn(16, 8) for _ in range(4)]):
            busy_step(model, x, ms=1)
    summary = prof.summary()
    assert set(gpu.recorded) == {1}  # events on cuda:1's stream, none on the idle current device
    assert all(r.device_s == pytest.approx(0.007) for r in prof.steps)
    # busy is the kernels' time on the busiest GPU, on the sampled steps only; not the events' span
    assert [r.kernel_s for r in prof.steps] == [pytest.approx(4e-4), None, pytest.approx(4e-4), None]
    assert gpu.traced == 2
    assert summary.device_busy_fraction == pytest.approx(4e-4 / (summary.mean_data_s + summary.mean_step_s))
    assert "300 MiB allocated on cuda:1" in summary.peak_memory and "cuda:0" not in summary.peak_memory


# a sampled step's trace on cuda:1 (name, device, stream, start and end in µs): stream 7 computes, stream 20
# copies ahead
_TRACE = [
    ("ampere_sgemm_128x64_nn", 1, 7, 0.0, 300.0),  # fp32 product without TF32
    ("void implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false>(int)", 1, 7, 300.0, 400.0),
    ("void cudnn::ops::nchwToNhwcKernel<__half, __half, float, true, false, 0>(int)", 1, 7, 400.0, 450.0),
    ("Memcpy HtoD (Pageable -> Device)", 1, 7, 450.0, 550.0),  # on the compute stream
    ("Memcpy HtoD (Pinned -> Device)", 1, 20, 0.0, 100.0),  # on a side stream, overlapping
    ("void at::native::vectorized_elementwise_kernel<4>(int)", 1, 7, 600.0, 610.0),
]


def _traced_run(monkeypatch, model, *, matmul_tf32: bool, cudnn_tf32: bool, capability=(9, 0)):
    _FakeCuda(monkeypatch, _TRACE, capability)
    monkeypatch.setattr(profiler_module, "matmul_allowed", lambda: matmul_tf32)
    monkeypatch.setattr(profiler_module, "cudnn_allowed", lambda: cudnn_tf32)
    with profile_steps(warmup=0, sample_every=2) as prof:
        for x in prof.iter([torch.randn(16, 8) for _ in range(4)]):
            busy_step(model, x, ms=1)
    return prof


def test_the_summary_weighs_each_kind_of_traced_gpu_work_against_the_step(monkeypatch, model) -> None:
    prof = _traced_run(monkeypatch, model, matmul_tf32=False, cudnn_tf32=True)  # torch's defaults
    assert [r.tf32 for r in prof.steps] == [(False, True), None, (False, True), None]  # sampled steps only
    s = prof.summary()
    total = s.mean_data_s + s.mean_step_s
    assert s.gpu_kernels_per_step == 4 and s.mean_kernel_s == pytest.approx(460e-6 / 4)
    assert s.device_busy_fraction == pytest.approx(560e-6 / total)  # 0-550 and 600-610
    assert s.fp32_matmul_fraction == pytest.approx(300e-6 / total)  # cuDNN's TF32 on: the conv not counted
    assert s.nchw_conv_fraction == pytest.approx(50e-6 / total)
    assert s.htod_compute_fraction == pytest.approx(100e-6 / total)  # the side stream's copy not counted
    assert s.tf32_capable is True
    assert "GPU kernels                4 per step, 115.0 µs each on average" in str(prof.report())

    convs_too = _traced_run(monkeypatch, model, matmul_tf32=False, cudnn_tf32=False).summary()
    assert convs_too.fp32_matmul_fraction == pytest.approx(
        400e-6 / (convs_too.mean_data_s + convs_too.mean_step_s)
    )
    assert (
        _traced_run(monkeypatch, model, matmul_tf32=True, cudnn_tf32=True).summary().fp32_matmul_fraction == 0
    )
    older = _traced_run(monkeypatch, model, matmul_tf32=False, cudnn_tf32=True, capability=(7, 5)).summary()
    assert older.tf32_capable is False and older.fp32_matmul_fraction is not None


def test_a_cpu_run_has_no_gpu_shares(model) -> None:
    with profile_steps(warmup=0, sample_every=1) as prof:
        for x in prof.iter([torch.randn(16, 8) for _ in range(3)]):
            busy_step(model, x, ms=1)
    s = prof.summary()
    assert all(r.gpu is None and r.tf32 is None for r in prof.steps)
    shares = (s.gpu_kernels_per_step, s.mean_kernel_s, s.fp32_matmul_fraction, s.nchw_conv_fraction)
    assert shares == (None,) * 4 and s.htod_compute_fraction is None and s.tf32_capable is None
    assert "GPU kernels" not in str(prof.report())


def test_a_profiler_of_the_users_is_not_cancelled_and_no_busy_time_is_guessed(monkeypatch, model) -> None:
    gpu = _FakeCuda(monkeypatch)
    monkeypatch.setattr(torch._C._autograd, "_profiler_enabled", lambda: True)
    with profile_steps(warmup=0, sample_every=1) as prof:
        for x in prof.iter([torch.randn(16, 8) for _ in range(3)]):
            busy_step(model, x, ms=1)
    assert gpu.traced == 0 and all(r.kernel_s is None for r in prof.steps)
    assert prof.summary().device_busy_fraction is None  # the events' span is not a busy time


def test_cuda_sync_count_skips_the_debug_modes_own_notice(monkeypatch, model) -> None:
    """CUDA's sync debug mode warns once per process that it is a prototype ("does not yet detect all
    synchronizing operations"): caught in the first sampled step, it is not a sync (it made a GPU loop
    with one ``.item()`` a step read 1.25 syncs per step)."""
    _FakeCuda(monkeypatch)
    with profile_steps(warmup=0, sample_every=1) as prof:
        for i, x in enumerate(prof.iter([torch.randn(16, 8) for _ in range(3)])):
            if i == 0:
                warnings.warn(
                    "Synchronization debug mode is a prototype feature and does not yet detect all "
                    "synchronizing operations (Triggered internally at Module.cpp:1003.)",
                    UserWarning,
                    stacklevel=1,
                )
            warnings.warn(
                "called a synchronizing CUDA operation (Triggered internally)", UserWarning, stacklevel=1
            )
            busy_step(model, x, ms=1)
    assert [r.syncs for r in prof.steps] == [1, 1, 1]


@pytest.mark.parametrize(
    ("spans", "seconds"),
    [
        ([], 0.0),
        ([(0.0, 10.0)], 10e-6),
        ([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)], 4e-6),  # unsorted, one overlap
        ([(0.0, 10.0), (2.0, 3.0), (4.0, 12.0)], 12e-6),  # one inside another
        ([(0.0, 1.0), (1.0, 2.0)], 2e-6),  # touching
    ],
)
def test_busy_seconds_is_the_union_of_the_kernels(spans, seconds) -> None:
    assert busy_seconds(spans) == pytest.approx(seconds, abs=1e-12)

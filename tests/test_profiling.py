"""profile_steps: timing, sync counts, each advice rule on its trigger loop and silent on a clean loop,
the mistake detectors, bad input, and the plot."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import speedups.profiling as profiling
from speedups import LossTracker, SpeedupsError, SpeedupsWarning, check, profile_steps
from speedups.profiling import Summary, advise
from tests._dist import free_port


class SlowDataset(Dataset):
    """Each item costs `delay` seconds (a stand-in for decoding and augmenting)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return torch.full((8,), float(i)), torch.tensor(i % 2)


def busy_step(model: nn.Module, x: torch.Tensor, ms: float = 4.0) -> torch.Tensor:
    """A step whose compute takes about `ms` milliseconds of wall time."""
    loss = model(x).pow(2).mean()
    loss.backward()
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass
    return loss


def rules_fired(prof) -> set[str]:
    return {a.rule for a in prof.advice()}


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def test_times_add_up_and_batch_sizes_are_read(model) -> None:
    batches = [torch.randn(16, 8) for _ in range(6)]
    with profile_steps(warmup=0, sample_every=1000) as prof:
        for x in prof.iter(batches):
            busy_step(model, x, ms=3)
    assert len(prof.steps) == 6
    assert all(r.samples == 16 for r in prof.steps)
    timed = [r for r in prof.steps if not r.sampled]
    assert all(0.0029 <= r.step_s < 0.5 for r in timed)
    assert all(r.data_s < 0.003 for r in timed)
    s = prof.summary()
    assert s.mean_step_s == pytest.approx(sum(r.step_s for r in timed) / len(timed))
    assert s.samples_per_s == pytest.approx(16 / (s.mean_data_s + s.mean_step_s))


def test_breaking_out_of_the_loop_closes_the_step(model) -> None:
    with profile_steps(warmup=0, sample_every=1) as prof:
        for i, _x in enumerate(prof.iter([torch.randn(2, 8)] * 5)):
            if i == 2:
                break
    assert len(prof.steps) == 3 and prof.steps[-1].syncs == 0
    # the sync-counting mode was popped: a later .item() is not counted anywhere
    assert torch.ones(()).item() == 1.0


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


# ------------------------------------------------------------------------------------------- the rules
def test_data_bound_and_num_workers_rules_fire_on_a_slow_loader(model, monkeypatch) -> None:
    monkeypatch.setattr(profiling, "usable_cpus", lambda: 4)
    loader = DataLoader(SlowDataset(40, 0.002), batch_size=4, num_workers=0)  # ~8 ms of data per step
    with profile_steps() as prof:
        for x, _ in prof.iter(loader):
            busy_step(model, x, ms=1)
    fired = rules_fired(prof)
    assert {"data-bound", "num-workers-0"} <= fired
    assert prof.advice()[0].rule == "data-bound"  # most valuable first
    text = str(prof.report())
    assert "waits for data" in text and "fast_loader" in text and "tune_loader" in text


def test_clean_loop_gets_no_advice(model, monkeypatch) -> None:
    monkeypatch.setattr(profiling, "usable_cpus", lambda: 4)
    batches = [torch.randn(16, 8) for _ in range(20)]
    tracker = LossTracker()
    with profile_steps(sample_every=5) as prof:
        for x in prof.iter(batches):
            tracker.update(busy_step(model, x, ms=3))
    assert prof.advice() == []
    assert "No tip applies" in str(prof.report())


def test_sync_bound_rule_fires_on_item_every_step(model) -> None:
    batches = [torch.randn(16, 8) for _ in range(12)]
    losses = []
    with profile_steps(sample_every=3) as prof:
        for x in prof.iter(batches):
            losses.append(busy_step(model, x, ms=1).item())  # a sync every step
    s = prof.summary()
    assert s.syncs_per_step == pytest.approx(1.0) and s.sampled_steps == 4
    assert "sync-bound" in rules_fired(prof)
    assert "LossTracker" in str(prof.report())


def test_cpu_bf16_rule_fires_only_without_native_bf16(model, monkeypatch) -> None:
    batches = [torch.randn(4, 8) for _ in range(3)]
    with profile_steps(warmup=0, sample_every=1) as prof:
        for x in prof.iter(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
    assert prof.summary().cpu_bf16_matmuls >= 3
    monkeypatch.setattr(profiling, "cpu_has_native_bf16", lambda: False)
    assert "cpu-bf16" in rules_fired(prof)
    assert "mixed_precision('auto')" in str(prof.report())
    monkeypatch.setattr(profiling, "cpu_has_native_bf16", lambda: True)
    assert "cpu-bf16" not in rules_fired(prof)

    with profile_steps(warmup=0, sample_every=1) as clean:  # fp32: silent even without native bf16
        for x in clean.iter(batches):
            model(x).sum().backward()
    monkeypatch.setattr(profiling, "cpu_has_native_bf16", lambda: False)
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


@pytest.mark.cuda
def test_sync_counting_on_gpu_uses_sync_debug_mode() -> None:
    model = nn.Linear(64, 64).cuda()
    with profile_steps(sample_every=1) as prof:
        for x in prof.iter([torch.randn(8, 64, device="cuda") for _ in range(4)]):
            model(x).sum().item()
    assert prof.summary().syncs_per_step >= 1
    assert torch.cuda.get_sync_debug_mode() == 0


# --------------------------------------------------------------------------------------- the detectors
def test_kept_graph_detector(model) -> None:
    batches = [torch.randn(4, 8) for _ in range(4)]
    losses = []
    with check() as chk, pytest.warns(SpeedupsWarning, match=r"losses.append\(loss.detach\(\)\)") as record:
        for x in chk.iter(batches):
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss)  # the mistake: keeps every step's graph
    assert len([w for w in record if "autograd graph" in str(w.message)]) == 1  # warns once

    losses.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        with check() as chk:
            for x in chk.iter(batches):
                loss = model(x).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())


def test_sampler_epoch_detector() -> None:
    data = list(range(20))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    with check() as chk, pytest.warns(SpeedupsWarning, match=r"set_epoch\(epoch\)"):
        for _ in range(2):  # the mistake: no set_epoch
            for _batch in chk.iter(loader):
                pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        with check() as chk:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                for _batch in chk.iter(loader):
                    pass


def test_no_sync_detector_on_a_one_process_ddp() -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with check(model=ddp), pytest.warns(SpeedupsWarning, match="forward inside too"):
            loss = F.mse_loss(ddp(x), y)  # the mistake: forward outside no_sync
            with ddp.no_sync():
                loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", SpeedupsWarning)
            with check(model=ddp):
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
                F.mse_loss(ddp(x), y).backward()  # a synced micro-step: fine
        assert not ddp._forward_hooks  # the detector's hook is removed on exit
    finally:
        torch.distributed.destroy_process_group()


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


def test_enabled_false_is_a_no_op(model) -> None:
    prof = profile_steps(enabled=False)

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    assert prof(step) is step
    data = [torch.ones(2, 8)]
    assert list(prof.iter(data)) == data and prof.steps == []
    with pytest.raises(SpeedupsError, match="disabled"):
        prof.report()


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


def test_flags_are_checked_and_a_profiler_cannot_be_entered_twice() -> None:
    from speedups import _step

    with pytest.raises(TypeError, match=r"enabled='no'"):
        profile_steps(enabled="no")
    with pytest.raises(TypeError, match=r"debug='yes'"):
        profile_steps(debug="yes")
    chk = check()
    with chk:
        with pytest.raises(SpeedupsError, match="already entered"), chk:
            pass
        assert _step.active_checker.get() is chk
    assert _step.active_checker.get() is None


def test_optimizer_step_by_hand_under_accumulate_detector(model) -> None:
    from speedups import _step, accumulate

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = accumulate(4, optimizer)(lambda x: model(x).pow(2).mean())
    batches = [torch.randn(4, 8) for _ in range(8)]
    with check() as chk, pytest.warns(SpeedupsWarning, match=r"optimizer.step\(\) was called by hand") as rec:
        for x in chk.iter(batches):
            train_step(x)
            optimizer.step()  # the mistake: @accumulate already steps on every 4th call
    assert len([w for w in rec if "by hand" in str(w.message)]) == 1  # warns once

    with warnings.catch_warnings():  # the correct loop: @accumulate's own steps are not flagged
        warnings.simplefilter("error", SpeedupsWarning)
        with check() as chk:
            for x in chk.iter(batches):
                train_step(x)
            train_step.flush()
    assert train_step.num_updates >= 2
    assert _step.active_checker.get() is None  # outside check() nothing is watched
    optimizer.step()  # and nothing is left registered to warn

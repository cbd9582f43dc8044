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
from speedups.profiling.advice import Summary, advise
from tests._profiling_loops import SlowDataset, busy_step


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def rules_fired(prof) -> set[str]:
    return {a.rule for a in prof.advice()}


def test_data_bound_and_num_workers_rules_fire_on_a_slow_loader(model, monkeypatch) -> None:
    monkeypatch.setattr(profiler, "usable_cpus", lambda: 4)
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
    monkeypatch.setattr(profiler, "usable_cpus", lambda: 4)
    batches = [torch.randn(16, 8) for _ in range(20)]
    tracker = LossTracker()
    with profile_steps(sample_every=5) as prof:
        for x in prof.iter(batches):
            tracker.update(busy_step(model, x, ms=3))
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

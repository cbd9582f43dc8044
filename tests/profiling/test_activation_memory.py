"""profile_steps(model=...): the bytes kept for backward per block, counted on one step, in the report, and
advice that names the blocks freeing the most memory per second of recompute."""

from __future__ import annotations

import torch
from torch import nn

from speedups import checkpoint_activations, profile_steps
from speedups.memory.saved_activations import OUTSIDE, SavedActivations
from speedups.profiling.activation_memory import ActivationMemory, BlockMemory
from speedups.profiling.advice import Summary, advise
from tests._models import Blocks


def run(model: nn.Module, steps: int = 3) -> object:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile_steps(model=model) as prof:
        for x in prof.iter([torch.randn(256, 3) for _ in range(steps)]):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return prof


def test_the_counted_bytes_are_those_saved_for_backward_by_hand() -> None:
    model = Blocks(depth=3, width=32)
    x = torch.randn(256, 3)
    # by hand: every tensor saved for backward, its storage counted once, parameters left out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).pow(2).mean().backward()
    with SavedActivations(model) as counted:
        model(x).pow(2).mean().backward()
    assert counted.total_bytes == sum(seen.values())
    assert sum(counted.bytes_by_block.values()) == counted.total_bytes
    # a block of width 32 on 256 rows: fc1's output (256 x 128 floats) among what it keeps
    assert counted.bytes_by_block["blocks.1"] >= 256 * 128 * 4
    assert counted.bytes_by_block[OUTSIDE] > 0  # pow and mean, outside the model's blocks
    assert counted.calls_by_block["blocks.0"] == 1


def test_report_lists_blocks_and_advice_names_the_ones_to_checkpoint() -> None:
    model = Blocks(depth=3, width=32)
    prof = run(model)
    assert prof.activations is not None  # type: ignore[attr-defined]
    text = str(prof.report())  # type: ignore[attr-defined]
    assert "kept for backward" in text and "blocks.0" in text
    assert "fix: checkpoint_activations(model, 'blocks.*')" in text
    advice = [a for a in prof.advice() if a.rule == "activation-memory"]  # type: ignore[attr-defined]
    assert len(advice) == 1 and "blocks.0" in advice[0].message

    checkpoint_activations(model, "blocks.*")
    after = run(model)
    text = str(after.report())  # type: ignore[attr-defined]
    assert "(checkpointed)" in text and "activation-memory" not in [a.rule for a in after.advice()]  # type: ignore[attr-defined]
    assert after.activations.peak_bytes < 0.5 * prof.activations.peak_bytes  # type: ignore[attr-defined]


def test_without_model_nothing_is_counted() -> None:
    prof = profile_steps()
    with prof:
        for x in prof.iter([torch.ones(2, 2)] * 3):
            (x * 2).sum()
    assert prof.activations is None and prof.summary().activations is None


def summary_with(a: ActivationMemory) -> Summary:
    return Summary(
        steps=5, mean_data_s=0.0, mean_step_s=1.0, data_fraction=0.0, syncs_per_step=0.0, sampled_steps=1,
        samples_per_s=None, mean_batch=None, device_type="cpu", device_busy_fraction=None,
        cache_frees_per_step=None, cpu_bf16_matmuls=0, native_cpu_bf16=True, loader_workers=None,
        usable_cpus=2, peak_memory="", activations=a,
    )  # fmt: skip


def test_advice_orders_blocks_by_bytes_freed_per_second_and_writes_patterns() -> None:
    mib = 2**20
    blocks = (
        BlockMemory("embed", 1 * mib, 0, 0.001),
        BlockMemory("h.0", 40 * mib, 4 * mib, 0.010),
        BlockMemory("h.1", 40 * mib, 4 * mib, 0.020),  # same bytes, twice the recompute: later
        BlockMemory("head", 30 * mib, 4 * mib, 0.001),  # fewer bytes, far cheaper: first
    )
    a = ActivationMemory(peak=111 * mib, total=111 * mib, parameters=10 * mib, blocks=blocks)
    assert [b.name for b in a.best_blocks()] == ["head", "h.0", "h.1"]
    (rule,) = [x for x in advise(summary_with(a)) if x.rule == "activation-memory"]
    assert "head, h.0, h.1" in rule.message and "98.0 MiB" in rule.message and "31.0 ms" in rule.message
    assert rule.fix == "checkpoint_activations(model, ['h.*', 'head'])"
    # activations smaller than the parameters: memory is not where the lever is
    small = ActivationMemory(peak=5 * mib, total=5 * mib, parameters=10 * mib, blocks=blocks)
    assert not [x for x in advise(summary_with(small)) if x.rule == "activation-memory"]

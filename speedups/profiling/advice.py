"""Which tip would help: rules over a profiled run's :class:`Summary`, and the :class:`Report` printing them.

Each rule reads the summary that ``StepProfiler.summary()`` makes (seconds, fractions and counts, nothing
else) and returns an :class:`Advice` that names the tip and shows the fix as code, or None. The rules name
the other tips in words only: this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speedups.profiling.activation_memory import ActivationMemory

__all__ = ["RULES", "Advice", "Report", "Summary", "advise"]


@dataclass(frozen=True)
class Advice:
    """One tip that would help, with its estimated value (the fraction of step time it could save)."""

    rule: str
    message: str
    fix: str
    value: float

    def __str__(self) -> str:
        return f"{self.message}\n     fix: {self.fix}"


@dataclass(frozen=True)
class Summary:
    """What the advice rules read: aggregates over the timed steps (seconds, fractions, counts).

    ``device_type`` is torch's device type string (``"cuda"`` when CUDA events timed the steps, else
    ``"cpu"``), as in ``torch.device.type``.
    """

    steps: int
    mean_data_s: float
    mean_step_s: float
    data_fraction: float
    syncs_per_step: float | None
    sampled_steps: int
    samples_per_s: float | None
    mean_batch: float | None
    device_type: str
    device_busy_fraction: float | None
    cache_frees_per_step: float | None
    cpu_bf16_matmuls: int
    native_cpu_bf16: bool
    loader_workers: int | None
    usable_cpus: int
    peak_memory: str
    median_data_s: float | None = None
    median_step_s: float | None = None
    p90_data_s: float | None = None
    p90_step_s: float | None = None
    activations: ActivationMemory | None = None


# ------------------------------------------------------------------------------------------ the rules
def _rule_data_bound(s: Summary) -> Advice | None:
    """A fifth or more of each step waits for data: a faster loader (tips 1 and 2)."""
    if s.data_fraction < 0.2:
        return None
    return Advice(
        "data-bound",
        f"{s.data_fraction:.0%} of each step waits for data.",
        "loader = fast_loader(dataset, batch_size=...); loader, report = tune_loader(loader)",
        s.data_fraction,
    )


def _rule_workers_zero(s: Summary) -> Advice | None:
    """The DataLoader loads in the training process while other CPUs are free."""
    if s.loader_workers != 0 or s.usable_cpus < 2 or s.data_fraction < 0.05:
        return None
    return Advice(
        "num-workers-0",
        f"The DataLoader loads in the training process (num_workers=0) while {s.usable_cpus} CPUs are "
        f"usable; {s.data_fraction:.0%} of each step waits for it.",
        "loader = fast_loader(dataset, batch_size=..., num_workers='auto')  # or tune_loader(loader)",
        0.9 * s.data_fraction,
    )


def _rule_sync_bound(s: Summary) -> Advice | None:
    """A host-device sync on every step: keep the loss on the device (``LossTracker``)."""
    if s.syncs_per_step is None or s.syncs_per_step < 1:
        return None
    return Advice(
        "sync-bound",
        f"A host-device sync every step ({s.syncs_per_step:.1f} per step, from .item(), float(t), print(t), "
        f".tolist() or a Python `if` on a tensor): each one waits for the device to finish.",
        "tracker = LossTracker(); tracker.update(loss, n=len(y))  # read it every N steps: f'{tracker:.4f}'",
        0.3 if s.device_type == "cuda" else 0.1,
    )


def _rule_empty_cache(s: Summary) -> Advice | None:
    """GPU memory goes back to the driver inside the loop (``torch.cuda.empty_cache()``)."""
    if s.cache_frees_per_step is None or s.cache_frees_per_step < 1:
        return None
    return Advice(
        "empty-cache",
        f"GPU memory goes back to the driver inside the loop ({s.cache_frees_per_step:.0f} frees per step): "
        f"torch.cuda.empty_cache() in the loop makes every step allocate from scratch.",
        "remove torch.cuda.empty_cache() from the training loop (call it once, if at all, after training)",
        0.25,
    )


def _rule_tiny_batches(s: Summary) -> Advice | None:
    """The GPU idles for most of a step that is not waiting for data: larger batches."""
    if s.device_type != "cuda" or s.device_busy_fraction is None or s.data_fraction >= 0.2:
        return None
    if s.device_busy_fraction >= 0.5:
        return None
    return Advice(
        "tiny-batches",
        f"The GPU is busy only {s.device_busy_fraction:.0%} of each step"
        + (f" with batches of {s.mean_batch:.0f}" if s.mean_batch else "")
        + ": Python and kernel launches dominate.",
        "bs = find_batch_size(probe_step, model, optimizer)  # larger batches; @accumulate keeps the math",
        1.0 - s.device_busy_fraction,
    )


def _rule_cpu_bf16(s: Summary) -> Advice | None:
    """bf16 matrix work on a CPU that emulates bf16."""
    if s.cpu_bf16_matmuls == 0 or s.native_cpu_bf16:
        return None
    return Advice(
        "cpu-bf16",
        "bf16 matrix work runs on a CPU without native bf16 (no AVX-512 BF16 or AMX): it is emulated, "
        "often ~30x slower than fp32.",
        "with mixed_precision('auto'):  # stays in fp32 on this CPU, bf16 where it is native",
        0.9,
    )


def _rule_activation_memory(s: Summary) -> Advice | None:
    """Activations kept for backward outweigh the parameters: checkpoint the blocks that free the most."""
    a = s.activations
    if a is None or a.peak < a.parameters:
        return None
    best = a.best_blocks()
    if not best:
        return None
    saving, seconds = sum(b.saving for b in best), sum(b.seconds for b in best)
    shown = ", ".join(b.name for b in best[:6]) + (f" and {len(best) - 6} more" if len(best) > 6 else "")
    return Advice(
        "activation-memory",
        f"Activations kept for backward peak at {_mib(a.peak)} ({a.peak / max(a.parameters, 1):.1f}x the "
        f"parameters). Checkpointing {shown} (most memory freed per recompute time first) would free about "
        f"{_mib(saving)} ({saving / max(a.total, 1):.0%}) for about {seconds * 1e3:.1f} ms more per step "
        f"(one more forward of them); with @accumulate(..., memory_budget=...) the plan chooses for you.",
        f"checkpoint_activations(model, {_names_as_written([b.name for b in best], a)})",
        0.0,  # memory, not time: listed after the tips that save time
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _names_as_written(names: list[str], a: ActivationMemory) -> str:
    """``names`` as a checkpoint_activations argument: ``"h.*"`` where they are every block under ``h``."""
    parents: dict[str, list[str]] = {}
    for block in a.blocks:
        parent = block.name.rpartition(".")[0]
        parents.setdefault(parent, []).append(block.name)
    chosen, written = set(names), []
    for parent, children in parents.items():
        if parent and len(children) > 1 and chosen.issuperset(children):
            written.append(f"{parent}.*")
            chosen -= set(children)
    written += [n for n in names if n in chosen]
    return repr(written[0]) if len(written) == 1 else repr(written)


RULES: tuple[Callable[[Summary], Advice | None], ...] = (
    _rule_data_bound,
    _rule_workers_zero,
    _rule_sync_bound,
    _rule_empty_cache,
    _rule_tiny_batches,
    _rule_cpu_bf16,
    _rule_activation_memory,
)


def _spread(median_s: float | None, p90_s: float | None) -> str:
    if median_s is None or p90_s is None:
        return ""
    return f"  median {median_s * 1e3:.3f}  p90 {p90_s * 1e3:.3f}"


def advise(summary: Summary) -> list[Advice]:
    """Apply every rule to ``summary``; return the tips that fire, most valuable first."""
    found = [a for rule in RULES if (a := rule(summary)) is not None]
    return sorted(found, key=lambda a: a.value, reverse=True)


@dataclass(frozen=True)
class Report:
    """What ``StepProfiler.report()`` returns; ``str(report)`` is the table followed by the advice."""

    summary: Summary
    advice: list[Advice]

    def __str__(self) -> str:
        s = self.summary
        ms = 1e3
        lines = [
            f"speedups.profile_steps: {s.steps} steps (mean, then median and p90, in ms)",
            f"  waiting for data   {s.mean_data_s * ms:9.3f} ms/step  ({s.data_fraction:.0%})"
            + _spread(s.median_data_s, s.p90_data_s),
            f"  in the step        {s.mean_step_s * ms:9.3f} ms/step  ({1 - s.data_fraction:.0%})"
            + _spread(s.median_step_s, s.p90_step_s),
        ]
        if s.device_busy_fraction is not None:
            lines.append(f"  GPU busy           {s.device_busy_fraction:9.0%} of each step")
        if s.syncs_per_step is not None:
            lines.append(
                f"  host-device syncs  {s.syncs_per_step:9.1f} per step (counted on {s.sampled_steps} steps)"
            )
        if s.samples_per_s is not None:
            lines.append(f"  throughput         {s.samples_per_s:9.1f} samples/s")
        lines.append(f"  peak memory        {s.peak_memory}")
        if s.activations is not None:
            lines += _activation_lines(s.activations)
        if self.advice:
            lines.append("What would help, most valuable first:")
            for i, a in enumerate(self.advice, 1):
                lines.append(f"  {i}. {a}")
        else:
            lines.append("No tip applies: the loop is neither data-bound nor sync-bound.")
        return "\n".join(lines)


def _activation_lines(a: ActivationMemory) -> list[str]:
    """The report's lines on the activations kept for backward: the peak, then the largest blocks."""
    lines = [f"  kept for backward  {_mib(a.peak)} at peak (counted on one step); by block, most first:"]
    blocks = sorted(a.blocks, key=lambda b: b.kept, reverse=True)
    for b in blocks[:6]:
        done = "  (checkpointed)" if b.checkpointed else ""
        lines.append(f"      {b.name:<24} {_mib(b.kept):>12}   forward {b.seconds * 1e3:8.3f} ms{done}")
    if len(blocks) > 6:
        rest = blocks[6:]
        lines.append(f"      ... {len(rest)} more blocks: {_mib(sum(b.kept for b in rest))}")
    return lines

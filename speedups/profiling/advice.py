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

    From the GPU trace of the sampled steps (busiest GPU; None without one), each fraction of the mean step
    (data wait included, as ``device_busy_fraction``): ``fp32_matmul_fraction``, fp32 matrix products and
    convolutions run on the CUDA cores where TF32 was off for them; ``nchw_conv_fraction``, NCHW
    convolutions in 16 bits and cuDNN's NCHW/NHWC transposes; ``htod_compute_fraction``, host-to-device
    copies on the compute stream (see :class:`~speedups.profiling.gpu_activity.GpuActivity`). Also
    ``gpu_kernels_per_step`` and ``mean_kernel_s``, and ``tf32_capable``: every GPU in use has TF32 tensor
    cores (compute capability 8.0 or later).

    ``cpu_fp32_matmul_share``: on a CPU that computes bf16 natively, where no bf16 matrix work was seen, the
    share of the mean step that the sampled steps' fp32 matrix FLOPs (forward and backward, from the calls'
    shapes) take at this CPU's measured fp32 matmul rate; None elsewhere.
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
    gpu_kernels_per_step: float | None = None
    mean_kernel_s: float | None = None
    fp32_matmul_fraction: float | None = None
    nchw_conv_fraction: float | None = None
    htod_compute_fraction: float | None = None
    tf32_capable: bool | None = None
    cpu_fp32_matmul_share: float | None = None


# Thresholds of the rules read from the GPU trace (fractions of the mean step; see each rule).
TF32_SHARE = 0.10
NCHW_SHARE = 0.10
HTOD_SHARE = 0.05
IDLE_BUSY = 0.5  # the GPU busy less than half of each step: tiny batches or launch-bound
LAUNCH_KERNELS = 10
LAUNCH_HOST_S = 100e-6
CPU_FP32_SHARE = 0.5  # fp32 matrix work on a native-bf16 CPU: half the step before bf16 is advised


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


def _gpu_idle(s: Summary) -> bool:
    """The GPU busy less than half of each step, and the step not waiting for data (that is data-bound)."""
    return (
        s.device_type == "cuda"
        and s.device_busy_fraction is not None
        and s.data_fraction < 0.2
        and s.device_busy_fraction < IDLE_BUSY
    )


def _launch_bound(s: Summary) -> bool:
    """The idle GPU waits for kernel launches: at least 10 kernels a step, launched at most 100 µs of host
    time apart on average (eager PyTorch spends about 10-50 µs of dispatch, autograd and launch per kernel;
    more means other host work, which CUDA graphs would not remove)."""
    n = s.gpu_kernels_per_step
    return _gpu_idle(s) and n is not None and n >= LAUNCH_KERNELS and s.mean_step_s / n <= LAUNCH_HOST_S


def _rule_tiny_batches(s: Summary) -> Advice | None:
    """The GPU idles for most of a step that is not waiting for data: larger batches.

    Where the trace shows the idle GPU waiting for the launches of many short kernels, "launch-bound" gives
    the advice instead (and names larger batches there): one cause, one item.
    """
    if not _gpu_idle(s) or _launch_bound(s):
        return None
    assert s.device_busy_fraction is not None  # for mypy: _gpu_idle checked it
    return Advice(
        "tiny-batches",
        f"The GPU is busy only {s.device_busy_fraction:.0%} of each step"
        + (f" with batches of {s.mean_batch:.0f}" if s.mean_batch else "")
        + ": Python and kernel launches dominate.",
        "bs = find_batch_size(probe_step, model, optimizer)  # larger batches; @accumulate keeps the math",
        1.0 - s.device_busy_fraction,
    )


def _rule_launch_bound(s: Summary) -> Advice | None:
    """The GPU idles between many short kernels the host launches one by one: CUDA graphs.

    Same symptom as tiny batches (the GPU busy under half the step, not waiting for data), told apart by the
    trace: many kernels, little host time per kernel (see :func:`_launch_bound`). Its value is the idle
    share, as tiny batches'; the message names larger batches too, which make each kernel longer.
    """
    if not _launch_bound(s):
        return None
    assert s.device_busy_fraction is not None and s.gpu_kernels_per_step is not None  # for mypy
    n, idle = s.gpu_kernels_per_step, 1.0 - s.device_busy_fraction
    mean = f"{s.mean_kernel_s * 1e6:.1f} µs each, " if s.mean_kernel_s is not None else ""
    return Advice(
        "launch-bound",
        f"The GPU is idle {idle:.0%} of each step between {n:.0f} short kernels ({mean}launched "
        f"{s.mean_step_s / n * 1e6:.0f} µs apart): the host's launches set the pace. CUDA graphs replay the "
        f"step's kernels in one launch; larger batches (find_batch_size) would make each kernel longer.",
        'model = torch.compile(model, mode="reduce-overhead")  # CUDA graphs; or per block: '
        'compile_blocks(model, "blocks.*", mode="reduce-overhead")',
        idle,
    )


def _rule_tf32(s: Summary) -> Advice | None:
    """fp32 matrix work on the CUDA cores of a GPU with TF32 tensor cores, TF32 off: ``fast_kernels()``.

    Fires from a tenth of the step: TF32 runs fp32 GEMMs several times faster (an A100: 156 TFLOP/s against
    19.5), so that share is at least about half saved.
    """
    share = s.fp32_matmul_fraction
    if s.device_type != "cuda" or not s.tf32_capable or share is None or share < TF32_SHARE:
        return None
    return Advice(
        "tf32-off",
        f"{share:.0%} of each step runs fp32 matrix products and convolutions on the CUDA cores with TF32 "
        f"off, on a GPU with TF32 tensor cores (compute capability 8.0+): TF32 runs them several times "
        f"faster (products within about 1e-3 relative).",
        "switch = fast_kernels(model)  # TF32 on (restore() puts it back); or bf16: with mixed_precision():",
        share,
    )


def _rule_nchw_convolutions(s: Summary) -> Advice | None:
    """Convolutions in NCHW, with cuDNN's transposes to and from NHWC: channels_last (``fast_kernels``).

    Fires from a tenth of the step: the transposes are pure overhead, gone with channels_last tensors.
    """
    share = s.nchw_conv_fraction
    if s.device_type != "cuda" or share is None or share < NCHW_SHARE:
        return None
    return Advice(
        "nchw-convolutions",
        f"{share:.0%} of each step runs convolutions on NCHW tensors: cuDNN transposes them to NHWC for its "
        f"tensor-core kernels and back (nchwToNhwc/nhwcToNchw), or runs slower NCHW kernels.",
        "fast_kernels(model)  # channels_last weights; and batches: x.to(memory_format=torch.channels_last)",
        share,
    )


def _rule_copies_on_compute_stream(s: Summary) -> Advice | None:
    """Host-to-device copies on the stream the kernels run on: copy ahead on a side stream.

    Fires from a twentieth of the step: a copy on a side stream overlaps the step before, so all of it can
    go.
    """
    share = s.htod_compute_fraction
    if s.device_type != "cuda" or share is None or share < HTOD_SHARE:
        return None
    return Advice(
        "copies-on-compute-stream",
        f"{share:.0%} of each step copies host-to-device on the stream the kernels run on: each kernel "
        f"after a copy waits for it.",
        "loader = prefetch_to_device(loader)  # batch i+1 copied on a side stream while step i computes",
        share,
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


def _rule_cpu_fp32_on_bf16(s: Summary) -> Advice | None:
    """fp32 matrix work on a CPU whose bf16 units would do it faster (AVX-512 BF16, AMX), from half the step:
    bf16 autocast. On a Sapphire Rapids Xeon a 4096-wide product ran 4.6x faster in bf16 and the GPT of
    ``benchmarks/language_model.py`` (products about two thirds of its fp32 step) trained 2.0x faster; a
    2-block, 128-wide GPT (about 40%) gained nothing, its attention and element-wise work as slow in bf16."""
    share = s.cpu_fp32_matmul_share
    if share is None or share < CPU_FP32_SHARE or s.device_type != "cpu":
        return None
    return Advice(
        "cpu-fp32-matmul",
        f"fp32 matrix products take about {share:.0%} of the step (their FLOPs at this CPU's fp32 rate) on "
        f"a CPU that computes bf16 natively (AVX-512 BF16 or AMX), where bf16 autocast runs large ones "
        f"several times faster (time the step both ways: the rest of it does not speed up alike).",
        "@mixed_precision() on the step function (or: with mixed_precision(): around forward and loss)",
        share / 2,  # bf16 at least halves the matrix work; the rest of the step stays
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
    _rule_launch_bound,
    _rule_tf32,
    _rule_nchw_convolutions,
    _rule_copies_on_compute_stream,
    _rule_cpu_bf16,
    _rule_cpu_fp32_on_bf16,
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
        if s.gpu_kernels_per_step is not None:
            mean = f", {s.mean_kernel_s * 1e6:.1f} µs each on average" if s.mean_kernel_s is not None else ""
            lines.append(f"  GPU kernels        {s.gpu_kernels_per_step:9.0f} per step{mean}")
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

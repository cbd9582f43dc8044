"""Benchmark: what each per-step wrapper costs per call, paired against the loop without it, in one process.

A tiny MLP (64-64-10), micro-batches of 32, one CPU thread, ``accumulate(4)``: a micro-step of about 0.2 ms
whose time is mostly per-call overhead, so what a wrapper adds shows. The variants run in short blocks of
calls, interleaved and rotated, group after group; each group gives the ratio and the difference of a
variant's time per call to its baseline's *in that group*, and the figures are the medians over the groups
(a shared machine's slow drift then cancels within a group, which whole-run timings cannot do).

The floor is a minimal ``wrapt`` decorator that does only what any accumulating decorator must (call the
function, scale the loss by ``1/N``, backward, count, step and zero at the boundary, detach): how close to
it ``@accumulate`` gets is what its checks, counters and composability cost. Beside it, each other per-step
wrapper against the same loop without it: ``mixed_precision`` stacked under ``@accumulate`` (against
``torch.autocast`` written in the step), ``LossTracker.update`` (against a hand-written running sum on the
device), ``MetricLogger.log``, ``RunDirectory.after_step`` and ``StopOnSignal.requested`` (against
nothing).

    python -m benchmarks.overhead            # about a minute
    python -m benchmarks.overhead --quick    # a few seconds, for the smoke test
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import wrapt
from torch import nn

from benchmarks._timing import write_section
from speedups import LossTracker, MetricLogger, accumulate, mixed_precision
from speedups.checkpoint import RunDirectory, StopOnSignal

EVERY = 4
Call = Callable[[], object]


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def hand_loop() -> Call:
    """The hand-written accumulation loop's micro-step (the article's ``loss / N``)."""
    model, opt = _model()
    x, y = _batch()
    calls = [0]

    def call() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y) / EVERY
        loss.backward()
        calls[0] += 1
        if calls[0] % EVERY == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    return call


def floor() -> Call:
    """A minimal wrapt decorator doing only what any accumulating decorator must."""
    model, opt = _model()
    x, y = _batch()
    calls = [0]

    @wrapt.decorator
    def accumulating(wrapped: Callable[..., torch.Tensor], instance: object, args: Any, kwargs: Any) -> Any:
        loss = wrapped(*args, **kwargs)
        (loss / EVERY).backward()
        calls[0] += 1
        if calls[0] % EVERY == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    @accumulating
    def step() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    return step


def stepped(extra: str = "") -> Call:
    """``@accumulate`` alone, or with one more per-step wrapper (``extra``) or its hand-written twin."""
    model, opt = _model()
    x, y = _batch()
    if extra == "mixed_precision":

        @accumulate(EVERY, opt)
        @mixed_precision("bf16", device_type="cpu")
        def step() -> torch.Tensor:
            return F.cross_entropy(model(x), y)

        return step
    if extra == "autocast":

        @accumulate(EVERY, opt)
        def step() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(model(x), y)

        return step

    @accumulate(EVERY, opt)
    def plain() -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    if not extra:
        return plain
    if extra == "running sum":
        total = torch.zeros(())

        def summed() -> None:
            total.add_(plain())

        return summed
    if extra == "LossTracker.update":
        tracker = LossTracker()
        return lambda: tracker.update(plain())
    if extra == "MetricLogger.log":
        logger = MetricLogger(tempfile.mkdtemp())  # its default: rows written every 50 logs
        return lambda: logger.log(plain.step, loss=plain())
    if extra == "RunDirectory.after_step":
        run = RunDirectory(tempfile.mkdtemp(), every_updates=10**9)  # checks every call, never saves here
        run.resume(model=model, optimizer=opt, step=plain)

        def after() -> None:
            plain()
            run.after_step()

        return after
    if extra == "StopOnSignal.requested":
        stop = StopOnSignal()

        def watched() -> None:
            plain()
            stop.requested()

        return watched
    raise ValueError(extra)


# (variant, its baseline): the figures printed, in this order
PAIRS = [
    ("@accumulate", "hand loop"),
    ("floor", "hand loop"),
    ("mixed_precision", "autocast"),
    ("LossTracker.update", "running sum"),
    ("MetricLogger.log", "@accumulate"),
    ("RunDirectory.after_step", "@accumulate"),
    ("StopOnSignal.requested", "@accumulate"),
]


def paired(calls: dict[str, Call], groups: int, block: int) -> dict[str, tuple[float, float]]:
    """``{variant: (median ratio, median difference in us per call)}`` against its baseline in ``PAIRS``.

    Each group times ``block`` calls of every variant, in an order rotated from group to group.
    """
    names = list(calls)
    for _ in range(max(2, block // 4)):  # warm-up: allocator, autograd's caches, the first windows
        for name in names:
            for _ in range(EVERY):
                calls[name]()
    ratios: dict[str, list[float]] = {v: [] for v, _ in PAIRS}
    deltas: dict[str, list[float]] = {v: [] for v, _ in PAIRS}
    for g in range(groups):
        order = names[g % len(names) :] + names[: g % len(names)]
        per_call = {}
        for name in order:
            call = calls[name]
            start = time.perf_counter()
            for _ in range(block):
                call()
            per_call[name] = (time.perf_counter() - start) / block
        for variant, base in PAIRS:
            ratios[variant].append(per_call[variant] / per_call[base])
            deltas[variant].append((per_call[variant] - per_call[base]) * 1e6)
    return {v: (statistics.median(ratios[v]), statistics.median(deltas[v])) for v, _ in PAIRS}


def summary(figures: dict[str, tuple[float, float]]) -> str:
    """The one line: ``overhead: @accumulate +X.X us per call (R.RRRx of the hand loop; floor F.FFFx),
    ...``."""
    ratio, delta = figures["@accumulate"]
    others = ", ".join(f"{name} {figures[name][1]:+.1f} us" for name, _ in PAIRS[2:])
    return (
        f"overhead: @accumulate {delta:+.1f} us per call ({ratio:.3f}x of the hand loop; floor "
        f"{figures['floor'][0]:.3f}x), {others}"
    )


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few groups, for the smoke test")
    parser.add_argument("--groups", type=int, default=300, help="groups of interleaved blocks (default 300)")
    parser.add_argument("--block", type=int, default=40, help="calls per variant per group (default 40)")
    args = parser.parse_args(argv)
    groups, block = (6, 8) if args.quick else (args.groups, args.block)
    torch.set_num_threads(1)
    calls: dict[str, Call] = {"hand loop": hand_loop(), "floor": floor(), "@accumulate": stepped()}
    for extra in ("autocast", "mixed_precision", "running sum", "LossTracker.update", "MetricLogger.log",
                  "RunDirectory.after_step", "StopOnSignal.requested"):  # fmt: skip
        calls[extra] = stepped(extra)
    figures = paired(calls, groups, block)
    lines = [
        f"per call, median of {groups} groups of {block} interleaved calls per variant; MLP 64-64-10, "
        f"batch 32, accumulate({EVERY}), 1 thread",
        "| variant | against | ratio | per call |",
        "|---|---|---|---|",
        *(f"| {v} | {b} | {figures[v][0]:.3f}x | {figures[v][1]:+.2f} us |" for v, b in PAIRS),
        "",
        summary(figures),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        write_section("overhead", text)
    return figures


if __name__ == "__main__":
    main()

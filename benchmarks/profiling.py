"""Overhead of profile_steps() and of LossTracker against the plain loop, and the .item() habit, in one run.

    python -m benchmarks.profiling           # full: a few hundred steps per variant, two workloads
    python -m benchmarks.profiling --quick   # smoke mode for CI

Two workloads, one thread: a tiny MLP (64-64-10, batch 32: ~0.1 ms steps, the worst case for any per-step
cost) and the example's CNN on 8x8 digits (batch 64: ~1 ms steps, closer to real training). Prints each
variant's time per step and its ratio to the plain loop; writes benchmarks/results/profiling.png.
Targets: profile_steps() within 3% of the plain loop on realistic steps; LossTracker.update no slower than
the `.item()` it replaces (on CPU tensors it reads the value as `.item()` does: a CPU read is not a sync).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups import LossTracker, profile_steps

Batch = tuple[torch.Tensor, torch.Tensor]


def tiny_mlp(steps: int) -> tuple[nn.Module, list[Batch]]:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(steps)]


def example_cnn(steps: int) -> tuple[nn.Module, list[Batch]]:
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveMaxPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip
    return model, [(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))) for _ in range(steps)]


def variants(model: nn.Module, batches: list[Batch]) -> dict[str, Callable[[], object]]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    def plain() -> None:
        for x, y in batches:
            step(x, y)

    def profiled() -> None:
        with profile_steps() as prof:
            for x, y in prof.iter(batches):
                step(x, y)

    def item_every_step() -> None:
        losses = [step(x, y).item() for x, y in batches]
        del losses

    def loss_tracker() -> None:
        tracker = LossTracker()
        for x, y in batches:
            tracker.update(step(x, y), n=len(y))
        tracker.compute()

    return {
        "plain loop": plain,
        "profile_steps()": profiled,
        "plain + .item() per step": item_every_step,
        "plain + LossTracker": loss_tracker,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    chart: dict[str, float] = {}
    for name, make, full_steps in [("tiny MLP", tiny_mlp, 400), ("example CNN", example_cnn, 150)]:
        steps, rounds = (30, 3) if args.quick else (full_steps, 9)
        model, batches = make(steps)
        seconds = compare(variants(model, batches), rounds=rounds)
        per_step = {v: 1e3 * s / steps for v, s in seconds.items()}
        title = f"{name}, 1 thread, {steps} steps, median of {rounds} rounds"
        print(ratio_table(title, per_step, "plain loop", unit="ms/step"))
        overhead = per_step["profile_steps()"] / per_step["plain loop"] - 1
        extra_us = 1e3 * (per_step["profile_steps()"] - per_step["plain loop"])
        print(f"profile_steps() overhead on the {name}: {100 * overhead:+.1f}% ({extra_us:+.1f} us/step)")
        tracked, item = per_step["plain + LossTracker"], per_step["plain + .item() per step"]
        print(
            f"LossTracker.update vs .item() per step on the {name}: {tracked / item:.3f}x "
            f"({1e3 * (tracked - item):+.1f} us/step; target: no slower)\n"
        )
        for v, ms in per_step.items():
            chart[f"{name}: {v}"] = ms / per_step["plain loop"]
    print(
        "target: < 3% on realistic steps; on a CPU .item() costs little, on a GPU each one stalls the queue."
    )
    print(f"chart: {save_chart(RESULTS / 'profiling.png', 'time per step, ratio to the plain loop', chart)}")
    return chart


if __name__ == "__main__":
    main()

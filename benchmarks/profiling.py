"""Overhead of profile_steps() and the cost of a per-step .item() against LossTracker, in one run.

    python -m benchmarks.profiling           # full: a few hundred steps per variant
    python -m benchmarks.profiling --quick   # smoke mode for CI

Prints each variant's time per step and its ratio to the plain loop; writes benchmarks/results/profiling.png.
Target: profile_steps() (default sampling) within 3% of the plain loop.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups import LossTracker, profile_steps


def make_loop(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(steps)]
    return model, optimizer, batches


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, rounds = (60, 3) if args.quick else (400, 9)
    model, optimizer, batches = make_loop(steps)

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
        losses = []
        for x, y in batches:
            losses.append(step(x, y).item())

    def loss_tracker() -> None:
        tracker = LossTracker()
        for x, y in batches:
            tracker.update(step(x, y), n=len(y))
        tracker.compute()

    seconds = compare(
        {
            "plain loop": plain,
            "profile_steps()": profiled,
            "plain + .item() per step": item_every_step,
            "plain + LossTracker": loss_tracker,
        },
        rounds=rounds,
    )
    per_step = {name: 1e3 * s / steps for name, s in seconds.items()}
    print(ratio_table(f"profiling overhead, tiny MLP 64-64-10, batch 32, 1 thread, {steps} steps", per_step,
                      "plain loop", unit="ms/step"))  # fmt: skip
    ratios = {name: s / per_step["plain loop"] for name, s in per_step.items()}
    print(f"profile_steps() overhead: {100 * (ratios['profile_steps()'] - 1):+.1f}% (target < 3%)")
    print("note: on a CPU .item() costs little; on a GPU each one stalls the launch queue.")
    chart = save_chart(RESULTS / "profiling.png", "time per step, ratio to the plain loop", ratios)
    print(f"chart: {chart}")
    return ratios


if __name__ == "__main__":
    main()

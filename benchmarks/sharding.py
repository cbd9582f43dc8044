"""Benchmark tip 8: the per-call cost of shard_model's hooks, against the same model left alone.

On CPU both variants run on the same device ({"encoder": "cpu", "decoder": "cpu"}), so the difference is
exactly what the hooks add (walking inputs and outputs, ``Tensor.to`` calls that find the tensor already in
place). Moving activations between real devices costs what the copies cost and is not measured here.

Run: ``python -m benchmarks.sharding`` (``--quick`` for a few-second smoke run).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups import shard_model


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1)


class Model(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.encoder = Block(d)
        self.pos = nn.Parameter(torch.zeros(d))
        self.decoder = Block(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x, mask=mask) + self.pos, mask=mask)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    d, batch, rounds, steps = (32, 16, 5, 20) if args.quick else (256, 64, 9, 100)

    torch.manual_seed(0)
    plain = Model(d)
    sharded = shard_model(copy.deepcopy(plain), {"encoder": "cpu", "decoder": "cpu"})
    x, mask = torch.randn(batch, 8, d), torch.ones(batch, 8)

    def train(model: nn.Module) -> None:
        for _ in range(steps):
            loss = F.mse_loss(model(x, mask), x)
            loss.backward()

    seconds = compare(
        {"plain": lambda: train(plain), "sharded cpu/cpu": lambda: train(sharded)}, rounds=rounds
    )
    per_step = {name: s / steps for name, s in seconds.items()}
    print(ratio_table(f"forward+backward per step (d={d}, batch={batch}x8)", per_step, "plain"))
    if not args.quick:
        save_chart(
            RESULTS / "sharding.png",
            "shard_model hooks, same device",
            {name: s / per_step["plain"] for name, s in per_step.items()},
        )
    return per_step


if __name__ == "__main__":
    main()

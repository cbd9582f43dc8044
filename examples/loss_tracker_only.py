"""A plain PyTorch loop whose one change is ``LossTracker`` in place of a list of ``loss.item()`` values.

Before:                                       After:
    losses = []                                   tracker = LossTracker()
    ...                                           ...
    losses.append(loss.item())  # sync/step       tracker.update(loss, n=len(y))  # no sync
    print(sum(losses) / len(losses))              print(tracker.end_epoch())      # one sync

Everything else is untouched plain PyTorch. Run: ``python examples/loss_tracker_only.py --epochs 3``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedups import LossTracker


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(512, 20)
    y = x @ torch.randn(20, 1) + 0.1 * torch.randn(512, 1)  # a noisy linear target
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    tracker = LossTracker()  # was: losses = []
    for epoch in range(args.epochs):
        for xb, yb in loader:
            loss = F.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tracker.update(loss, n=len(yb))  # was: losses.append(loss.item())
        print(f"epoch {epoch + 1}: train_loss={tracker.end_epoch():.4f}")  # was: sum(losses) / len(losses)
    return tracker.history


if __name__ == "__main__":
    main()

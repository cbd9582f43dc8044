"""Worker: a small training loop under ``deterministic(seed=SEED)`` that saves its final weights.

Usage: determinism_train.py SEED OUT_FILE. The loop: ``fast_loader`` with 2 workers over a dataset whose
``__getitem__`` draws random augmentation from torch, ``random`` and numpy, shuffled, 3 epochs; a small MLP
with dropout and AdamW in float64. Two fresh processes with the same seed must save bit-identical weights.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from speedups import fast_loader
from speedups.kernels.reproducible import deterministic
from tests._loading_data import Augmented


def main(seed: int, out: str) -> None:
    switch = deterministic(seed=seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = fast_loader(Augmented(48), 8, shuffle=True, num_workers=2)
    assert loader.num_workers == 2
    for _ in range(3):
        for rows in loader:  # (8, 5) float64: the index, then 4 random draws made in the worker
            x, y = rows[:, 1:], rows[:, :1] / 48
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.save(model.state_dict(), out)
    switch.restore()


if __name__ == "__main__":  # spawn workers import this module: train only in the main process
    main(int(sys.argv[1]), sys.argv[2])

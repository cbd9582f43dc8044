"""Worker: each rank's augmented samples of 2 epochs under distributed(..., sample_seeds=True), 2 workers.

Usage: ``torchrun --nproc-per-node 2 sample_seeds_ranks.py OUT_DIR``; writes ``samples-rank<r>.pt``: per
epoch, the (rows, 5) float64 tensor of that rank's items (index, then draws from torch, random and numpy).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from speedups import distributed, fast_loader
from tests._loading_data import Augmented

dist.init_process_group("gloo")
loader = distributed(fast_loader(Augmented(24), 2, shuffle=True, num_workers=2), seed=5, sample_seeds=True)
epochs = [torch.cat(list(loader)) for _ in range(2)]
torch.save(epochs, Path(sys.argv[1]) / f"samples-rank{dist.get_rank()}.pt")
dist.destroy_process_group()

"""Worker: compile_blocks under DDP and FSDP2 against the same runs without it, on 2 gloo ranks.

Usage: compile_parallel.py OUT_DIR. Every rank trains each configuration from the same seeds on its own data
(5 calls of 8 rows per epoch, 2 epochs, ``@accumulate(3, model=...)``: a full window, then a short one that
``epoch()`` flushes), dropout drawing from a per-rank seed. Configurations: the plain model, then
``compile_blocks(model, "blocks.*", backend="eager")`` before and after wrapping (names of the plain model);
for FSDP2 (when torch has it) also each block sharded on its own (``fully_shard(block)``) before or after
compiling it. Saves rank<R>.pt: ``{configuration: {"params": [...] (full tensors), "losses": [...],
"compiled": compiled_blocks(model)}}``.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from speedups import accumulate, compile_blocks, ddp_wrap, destroy_distributed
from speedups.kernels.compiling import compiled_blocks
from tests._models import Blocks

try:  # torch.distributed does not import its fsdp package by itself
    from torch.distributed.fsdp import fully_shard
except ImportError:
    fully_shard = None

EVERY, CALLS, EPOCHS = 3, 5, 2
out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(100 + rank)
data = [
    [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(CALLS)]
    for _ in range(EPOCHS)
]


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(build):
    plain, model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step = accumulate(EVERY, opt, model=model)(lambda x, y: F.mse_loss(model(x), y))
    torch.manual_seed(1000 + rank)
    losses = [train_step(x, y).item() for epoch in data for x, y in train_step.epoch(epoch)]
    assert train_step.num_updates == 2 * EPOCHS, train_step.num_updates
    return {
        "params": [full(p) for p in plain.parameters()],
        "losses": losses,
        "compiled": compiled_blocks(model),
    }


def build(strategy, kind, per_block=False):
    def make():
        plain = Blocks(depth=2)
        if kind == "before":
            compile_blocks(plain, "blocks.*", backend="eager")
        if per_block:
            for block in plain.blocks:
                fully_shard(block)
        model = ddp_wrap(plain, strategy=strategy)
        if kind == "after":
            assert compile_blocks(model, "blocks.*", backend="eager") is model
        return plain, model

    return make


configs = {f"ddp_{k}": build("ddp", k) for k in ("plain", "before", "after")}
if fully_shard is not None:
    configs |= {f"fsdp_{k}": build("fsdp", k) for k in ("plain", "before", "after")}
    configs |= {f"fsdp_blocks_{k}": build("fsdp", k, per_block=True) for k in ("plain", "before", "after")}
results = {name: train(make) for name, make in configs.items()}
torch.save(results, out / f"rank{rank}.pt")
destroy_distributed()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

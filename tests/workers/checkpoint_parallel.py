"""Worker: checkpoint_activations under DDP and FSDP2 against the same runs without it, on 2 gloo ranks.

Usage: checkpoint_parallel.py OUT_DIR. Every rank trains each configuration below from the same seeds on its
own data (5 calls of 8 rows per epoch, 2 epochs, ``@accumulate(3, model=...)``: a full window, then a short
one of 2 that ``epoch()`` flushes), with dropout drawing from a per-rank seed. Configurations: the plain
model, ``checkpoint_activations(model, "blocks.*")`` before and after wrapping (names of the plain model),
and ``Blocks(hand=True)`` (``torch.utils.checkpoint`` by hand); for DDP also a BatchNorm pair (buffers);
for FSDP2 (when torch has it) also each block sharded on its own (``fully_shard(block)`` before
``ddp_wrap``), where FSDP2's hooks and ours sit on the same modules. Saves rank<R>.pt: ``{configuration:
{"params": [...], "buffers": [...] (full tensors), "all_reduces": DDP bucket all-reduces, "runs": forwards
of blocks.0.fc1}}`` and ``"losses"`` (``{configuration: the step's losses}``); no FSDP2 configuration where
torch has none.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from speedups import accumulate, checkpoint_activations, ddp_wrap, destroy_distributed
from tests._dist import count_all_reduces
from tests._models import Blocks

try:  # not tests._dist.HAS_FSDP2: torch.distributed does not import its fsdp package by itself
    from torch.distributed.fsdp import fully_shard
except ImportError:
    fully_shard = None

EVERY, CALLS, EPOCHS = 3, 5, 2
out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()

g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
data = [
    [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(CALLS)]
    for _ in range(EPOCHS)
]


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(build):
    """Build (plain module, the model to call), train it; return its state and the bucket all-reduces."""
    plain, model = build()
    runs = [0]  # forwards of blocks.0.fc1: two per call when its block recomputes
    plain.blocks[0].fc1.register_forward_pre_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    calls = count_all_reduces(model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step = accumulate(EVERY, opt, model=model)(lambda x, y: F.mse_loss(model(x), y))
    torch.manual_seed(1000 + rank)  # the dropout masks: the same in every configuration of this rank
    losses = []
    for epoch in data:
        for x, y in train_step.epoch(epoch):
            losses.append(train_step(x, y).item())
    assert train_step.num_updates == 2 * EPOCHS, train_step.num_updates
    params, buffers = [full(p) for p in plain.parameters()], [full(b) for b in plain.buffers()]
    reduces = None if calls is None else calls[0]
    return {"params": params, "buffers": buffers, "all_reduces": reduces, "runs": runs[0]}, losses


def ddp(kind, norm="layer"):
    def build():
        plain = Blocks(depth=2, norm=norm, hand=kind == "hand")
        if kind == "before":
            checkpoint_activations(plain, "blocks.*")
        model = ddp_wrap(plain)
        if kind == "after":
            assert checkpoint_activations(model, "blocks.*") is model
        return plain, model

    return build


def fsdp(kind, per_block=False):
    def build():
        plain = Blocks(depth=2, hand=kind == "hand")
        if kind == "before":
            checkpoint_activations(plain, "blocks.*")
        if per_block:
            for block in plain.blocks:
                fully_shard(block)
        model = ddp_wrap(plain, strategy="fsdp")
        if kind == "after":
            assert checkpoint_activations(model, "blocks.*") is model
        return plain, model

    return build


configs = {f"ddp_{k}": ddp(k) for k in ("plain", "before", "after", "hand")}
configs |= {f"ddp_batch_{k}": ddp(k, norm="batch") for k in ("plain", "after")}
if fully_shard is not None:
    configs |= {f"fsdp_{k}": fsdp(k) for k in ("plain", "before", "after", "hand")}
    configs |= {f"fsdp_blocks_{k}": fsdp(k, per_block=True) for k in ("plain", "before", "after")}

results, losses = {}, {}
for name, build in configs.items():
    results[name], losses[name] = train(build)
results["losses"] = losses
torch.save(results, out / f"rank{rank}.pt")
destroy_distributed()  # gc, then a barrier: the DDP models are gone before the group
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # torch 2.14 + gloo sometimes aborts in interpreter finalisation after all has run

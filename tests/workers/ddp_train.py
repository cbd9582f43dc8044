"""Worker: DDP training through ddp_wrap + distributed(loader) + checkpoints; optional crash and resume.

Usage: ``ddp_train.py OUT_DIR [--ckpt-every K] [--kill-at STEP] [--checks]``. Writes ``OUT_DIR/rank<R>.json``
with the final weights and what the checks saw. With ``--kill-at``, global rank 1 exits hard after that
optimizer step on the first attempt (``TORCHELASTIC_RESTART_COUNT=0``); torchrun restarts the job and it
resumes from ``OUT_DIR/ckpt.pt``.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedups import (
    LossTracker,
    checkpoint_values,
    ddp_wrap,
    destroy_distributed,
    distributed,
    is_main_process,
    load_checkpoint,
    rank_zero_print,
    save_checkpoint,
    seed_everything,
)
from tests._dist import HAS_FSDP2

EPOCHS, N, BATCH = 2, 48, 4


def make_data():
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 5, generator=g)
    y = x @ torch.randn(5, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(x, y)


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--ckpt-every", type=int, default=0)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--checks", action="store_true")
args = parser.parse_args()
out = Path(args.out)
ckpt = out / "ckpt.pt"

seed_everything(0)
model = ddp_wrap(nn.Linear(5, 1))
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
loader = distributed(DataLoader(make_data(), batch_size=BATCH, shuffle=True))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
tracker = LossTracker(all_ranks=True)
step = 0
if ckpt.exists():
    step = load_checkpoint(ckpt, model=model, optimizer=optimizer, loader=loader, tracker=tracker)["step"]
    rank_zero_print(f"resumed at step {step}, loader {loader.state_dict()}")

for _ in range(loader.state_dict()["epoch"], EPOCHS):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tracker.update(loss, n=len(y))
        step += 1
        if args.ckpt_every and step % args.ckpt_every == 0:
            save_checkpoint(ckpt, model=model, optimizer=optimizer, loader=loader, tracker=tracker, step=step)
        if step == args.kill_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os._exit(3)  # a crash: no cleanup, no checkpoint
    tracker.end_epoch()  # collective: every rank reads

result = {
    "rank": rank,
    "world": world,
    "steps": step,
    "weight": model.module.weight.detach().flatten().tolist(),
    "bias": model.module.bias.detach().tolist(),
    "history": tracker.history,
    "sampler_rank": loader.distributed_sampler.rank,
    "sampler_replicas": loader.distributed_sampler.num_replicas,
    "is_main": is_main_process(),
}

if args.checks:
    # Evaluation with even=False: 11 samples on 2 ranks, every sample exactly once, unequal batch counts.
    val = distributed(DataLoader(torch.arange(11, dtype=torch.float64), batch_size=3), even=False)
    seen, evaluated = [], LossTracker(all_ranks=True)
    for batch in val:
        seen += batch.long().tolist()
        evaluated.update(batch.mean(), n=len(batch))  # the "loss" of a sample is its index
    if rank == 1:
        evaluated.update(100.0, n=2)  # unequal counts per rank, and a host-side value
    result["val_seen"] = seen
    result["val_mean"] = evaluated.compute()  # one all-reduce, every rank reads
    rank_zero_print("printed once by rank zero")

    if HAS_FSDP2:  # public from torch 2.6
        # FSDP2 through ddp_wrap, and torch.distributed.checkpoint through save/load_checkpoint.
        seed_everything(1)
        sharded = ddp_wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), strategy="fsdp")
        opt = torch.optim.Adam(sharded.parameters(), lr=0.01)

        def train_step():
            sharded(torch.randn(6, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()

        def full():
            return [p.full_tensor().detach().clone() for p in sharded.parameters()]

        train_step()
        own = LossTracker()  # a per-rank object: each rank's own sum goes into the directory and comes back
        own.update(float(10 + rank))
        save_checkpoint(out / "fsdp_ckpt", model=sharded, optimizer=opt, tracker=own, step=0)
        save_checkpoint(out / "fsdp_ckpt", model=sharded, optimizer=opt, tracker=own, step=1)  # over it
        saved = full()
        train_step()
        changed = full()
        fresh = LossTracker()
        extra = load_checkpoint(out / "fsdp_ckpt", model=sharded, optimizer=opt, tracker=fresh)
        result["fsdp_own_tracker"] = fresh.compute()
        result["fsdp_leftovers"] = sorted(p.name for p in out.iterdir() if p.name.startswith(".fsdp_ckpt"))
        restored = full()
        result["fsdp_changed"] = any(not torch.equal(a, b) for a, b in zip(saved, changed, strict=True))
        result["fsdp_restored"] = all(torch.equal(a, b) for a, b in zip(saved, restored, strict=True))
        result["fsdp_extra"] = extra
        result["fsdp_values"] = checkpoint_values(out / "fsdp_ckpt")  # this rank alone reads the plain values
        train_step()  # the restored optimizer state works

(out / f"rank{rank}.json").write_text(json.dumps(result))
del model, optimizer  # the DDP model must be gone before the process group (see destroy_distributed)
if args.checks and HAS_FSDP2:
    del sharded, opt
destroy_distributed()

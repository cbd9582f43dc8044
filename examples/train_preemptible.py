"""A long run that survives preemption: periodic checkpoints, a clean stop on SIGTERM/SIGUSR1, resumes.

    python examples/train_preemptible.py --run-dir runs/pre                  # one process
    torchrun --nproc-per-node 2 examples/train_preemptible.py --run-dir runs/pre
    torchrun --nproc-per-node 2 examples/train_preemptible.py --run-dir runs/pre --accumulate 2
    python examples/train_preemptible.py --run-dir runs/pre --accumulate 4   # the same run, resumed on 1

Kill it anywhere (``kill -TERM`` the torchrun agent or a process, SIGKILL one worker) and run the same command
again: it resumes from the newest complete checkpoint in ``--run-dir`` and ends with the same weights
as a run that was never stopped (bit for bit on the same layout; to float rounding with ``--dropout 0`` on
another number of processes that keeps the global batch, processes x ``--accumulate`` x ``--batch-size``).

The run: a synthetic 10-class dataset whose ``__getitem__`` decodes (``--item-ms`` of simulated work) and
randomly augments each sample, loaded by 2 workers with ``sample_seeds=True`` (the same augmentation for any
layout or restart); an MLP with dropout; AdamW with linear warm-up then cosine decay; ``@accumulate`` with
``max_grad_norm=1.0``; a ``LossTracker``. ``RunDirectory`` saves every ``--save-every`` updates (and keeps the
last 3), resumes from the newest complete checkpoint (skipping a damaged one), and on SIGTERM or SIGUSR1
saves at the micro-step every rank agrees on and exits with status 75. Rank 0 prints ``step U M`` (updates,
micro-steps) after each micro-step, ``resumed: micro_step=M`` after loading a checkpoint, and writes
``<run-dir>/final.pt`` (the model's ``state_dict()``) at the end.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from speedups import (
    LossTracker,
    RunDirectory,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    distributed,
    fast_loader,
    rank,
    world_size,
)

FEATURES, CLASSES = 32, 10


class SyntheticSamples(Dataset):
    """``size`` samples of 10 Gaussian clusters; each item is "decoded" (``item_ms`` of work) and augmented
    with random noise, feature dropout and scaling drawn from torch and ``random``."""

    def __init__(self, size: int, item_ms: float) -> None:
        g = torch.Generator().manual_seed(1234)
        centers = torch.randn(CLASSES, FEATURES, generator=g) * 2
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.inputs = centers[self.labels] + torch.randn(size, FEATURES, generator=g)
        self.item_s = item_ms / 1000

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.item_s:
            time.sleep(self.item_s)  # reading and decoding a file would take this long
        x = self.inputs[i] + 0.3 * torch.randn(FEATURES)
        x = x * (torch.rand(FEATURES) > 0.1) * random.uniform(0.8, 1.2)
        return x, self.labels[i]


def build(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed + rank())  # each rank its own dropout masks (DDP makes the weights equal)
    model = nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Dropout(args.dropout),
        nn.Linear(128, 128), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(128, CLASSES),
    )  # fmt: skip
    model = ddp_wrap(model)  # speedups: the process group and DDP under torchrun; the model itself alone
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(args.updates // 10, 1)

    def schedule(update: int) -> float:  # linear warm-up, then cosine decay to 0 at --updates
        if update < warmup:
            return (update + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (update - warmup) / max(args.updates - warmup, 1)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = SyntheticSamples(args.samples, args.item_ms)
    loader = distributed(  # speedups: the same global order on any number of processes, resumable mid-epoch
        fast_loader(data, args.batch_size, shuffle=True, num_workers=2, seed=args.seed, sample_seeds=True)
    )

    @accumulate(args.accumulate, optimizer, scheduler=scheduler, max_grad_norm=1.0, model=model)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    tracker = LossTracker(all_ranks=True)
    return dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, step=train_step,
                tracker=tracker)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints go here; resumed from here")
    parser.add_argument("--updates", type=int, default=48, help="optimizer steps of the whole run")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch, per process")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=192, help="dataset size")
    parser.add_argument("--item-ms", type=float, default=1.0, help="simulated loading time per sample")
    parser.add_argument("--save-every", type=int, default=4, help="updates between periodic checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    state = build(args)
    train_step, loader, tracker = state["step"], state["loader"], state["tracker"]
    run = RunDirectory(args.run_dir, every_updates=args.save_every, keep=3)  # speedups: SIGTERM/SIGUSR1 too
    values = run.resume(**state)  # speedups: the newest complete checkpoint, or {} for a new run
    if values and rank() == 0:
        print(f"resumed: micro_step={train_step.step}", flush=True)
    epoch = values.get("epoch", 0)
    while train_step.num_updates < args.updates:
        for x, y in train_step.epoch(loader):
            tracker.update(train_step(x, y), n=len(y))
            if rank() == 0:
                print(f"step {train_step.num_updates} {train_step.step}", flush=True)
            run.after_step(epoch=epoch)  # speedups: saves when due; on a stop signal, saves here and exits
            if train_step.num_updates >= args.updates and train_step.pending == 0:
                break
        else:
            epoch += 1
            continue
        break
    run.close()
    mean = tracker.compute()  # every rank: one all-reduce
    if rank() == 0:
        print(f"done: {train_step.num_updates} updates on {world_size()} process(es), mean loss {mean:.4f}")
        torch.save(getattr(state["model"], "module", state["model"]).state_dict(), args.run_dir / "final.pt")
    del state, train_step, loader
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])

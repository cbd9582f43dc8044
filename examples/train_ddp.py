"""The digits example in data-parallel form: ``ddp_wrap`` + ``distributed(loader)``, launched by torchrun.

    torchrun --nproc-per-node 2 examples/train_ddp.py      # 2 processes on one machine (CPU: gloo, GPU: nccl)
    python examples/train_ddp.py --launch 2                # the same 2 processes started by speedups.launch()
    srun --ntasks-per-node 2 python examples/train_ddp.py  # SLURM: one task per process
    python examples/train_ddp.py                           # the same script as one plain process
    torchrun --nnodes 2 --node-rank $i --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint host0:29400 examples/train_ddp.py  # two nodes of 8 GPUs

The data, model and evaluation are those of ``examples/train_digits.py`` (imported, not copied). Each rank
trains on its share of every epoch's batches; evaluation uses ``even=False`` so each test image is counted
exactly once, and the accuracy is summed across ranks with one all-reduce. Prints ``test_accuracy=<float>``
last (on rank 0).

What speedups changes against a plain single-process loop (each marked ``# speedups``):
- ``ddp_wrap(model)``: process group from the environment, ``cuda:LOCAL_RANK``, DistributedDataParallel.
- ``distributed(loader)``: a DistributedSampler whose epoch advances by itself (no forgotten set_epoch).
- ``LossTracker(all_ranks=True)``: the global weighted mean of the loss, one all-reduce per read.
- ``launch(main, argv, nprocs=N)`` (``--launch N``): the processes started from the script itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import SmallCNN, load_digits_split

from speedups import (
    LossTracker,
    ddp_wrap,
    default_device,
    destroy_distributed,
    distributed,
    launch,
    rank_zero_print,
    seed_everything,
    to_device,
)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy over the whole test set: each rank counts its share, one all-reduce sums them."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # [correct, total], summed on device
    for batch in loader:  # even=False: unequal batch counts per rank, so no collective inside this loop
        x, y = to_device(batch, device)  # speedups
        counts[0] += (model(x).argmax(dim=1) == y).sum()
        counts[1] += len(y)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)  # every rank joins, after the loop
    model.train()
    correct, total = counts.tolist()  # one sync for the whole evaluation
    return correct / total


def main(argv: list[str] | None = None) -> float:
    args = _parser().parse_args(argv)
    if args.launch:  # speedups: start the processes here instead of under torchrun
        each = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                "--seed", str(args.seed)]  # fmt: skip
        accuracies = launch(main, each, nprocs=args.launch)  # one result per rank, in rank order
        return float(accuracies[0])
    accuracy = train(args)
    destroy_distributed()  # speedups: after train() returned, so the DDP model is gone first
    return accuracy


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch", type=int, default=0, metavar="N", help="start N processes with launch()")
    return parser


def train(args: argparse.Namespace) -> float:

    seed_everything(args.seed)  # speedups: the same initial weights and order on every rank
    train_set, test_set = load_digits_split(args.seed)
    model = ddp_wrap(SmallCNN())  # speedups: process group, device cuda:LOCAL_RANK, DDP
    device = default_device()
    train_loader = distributed(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True), seed=args.seed
    )
    test_loader = distributed(DataLoader(test_set, batch_size=512), even=False)  # every image exactly once
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    tracker = LossTracker(all_ranks=True)  # speedups: reads are the mean over all ranks (all must read)

    accuracy = 0.0
    for epoch in range(args.epochs):
        for batch in train_loader:  # speedups: a new epoch (and order) each pass, identical on all ranks
            x, y = to_device(batch, device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            tracker.update(loss, n=len(y))  # no sync
        train_loss = tracker.end_epoch()  # one all-reduce: every rank reads
        accuracy = evaluate(model, test_loader, device)
        rank_zero_print(f"epoch {epoch + 1}: train_loss={train_loss:.4f} test_accuracy={accuracy:.4f}")

    rank_zero_print(f"test_accuracy={accuracy:.4f}")  # the line scripts parse
    return accuracy


if __name__ == "__main__":
    main()

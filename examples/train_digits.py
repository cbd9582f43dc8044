"""The main job: a plain PyTorch training loop on real handwritten digits, upgraded with speedups.

Trains a small CNN with Adam on the 1,797 8x8 digit images that ship inside scikit-learn (no download),
holding out 20% for test, and prints the final line ``test_accuracy=<float>`` for scripts to parse.
``--dataset mnist --data-root DIR`` trains on MNIST through torchvision instead.

    python examples/train_digits.py                      # digits, about 10 s on 2 CPU cores
    python examples/train_digits.py --log-dir runs/digits   # + metrics.csv (TensorBoard) and curves.png
    python examples/train_digits.py --dataset mnist --data-root ./data --download

What speedups changes against the plain loop (each marked ``# speedups`` below):
- ``tune_loader(loader, step=...)`` times the step (on a copy of the model, about 2 s) with all of
  this process's cores as torch compute threads, half as many and one, and keeps the fastest
  (``torch.set_num_threads``): a core busy with another program makes threads wait on each other, several
  times slower. ``--threads N`` fixes the count instead (float rounding depends on it).
- ``to_device(batch)`` moves the whole batch, whatever its nesting, to this process's device.
- ``LossTracker`` keeps the running loss on the device: no ``.item()`` sync on every step.
- ``@accumulate(N, optimizer)`` runs backward and, every N micro-batches, the optimizer step: exactly the
  big batch (``--accumulate 4`` trains with batches of 4 x 64 in the memory of 64).
- ``--micro-batch-size auto`` splits each batch into micro-batches that fit, found on out of memory while
  training (``N`` splits into micro-batches of N rows): the same gradients as the whole batch.
- ``MetricLogger`` (``--log-dir``) logs every optimizer step's loss and learning rate from device tensors
  without a sync, and ``plot_metrics`` draws the curves to ``curves.png``.
- ``mixed_precision()`` runs the forward pass in 16-bit autocast (``--precision auto`` picks what this device
  is fast at, and stays in fp32 with a warning where 16-bit would be slower; fp16 adds loss scaling).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from speedups import (
    LossTracker,
    MetricLogger,
    accumulate,
    fast_loader,
    mixed_precision,
    plot_metrics,
    resolve_device,
    to_device,
    tune_loader,
)


def load_digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits from scikit-learn as (N, 1, 8, 8) float32 in [0, 1] and int64 labels; 80/20 stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )


def load_mnist_split(root: str, download: bool) -> tuple[TensorDataset, TensorDataset]:
    """MNIST from torchvision as (N, 1, 28, 28) float32 in [0, 1] and int64 labels (its own train/test)."""
    from torchvision.datasets import MNIST

    def as_tensors(train: bool) -> TensorDataset:
        ds = MNIST(root, train=train, download=download)
        return TensorDataset(ds.data.unsqueeze(1).float() / 255.0, ds.targets.long())

    try:
        return as_tensors(True), as_tensors(False)
    except RuntimeError as err:
        if download:
            raise
        sys.exit(
            f"error: MNIST files not found under --data-root {root!r} ({err}). "
            f"Add --download to fetch them (about 12 MB), "
            f"or point --data-root at a folder that holds MNIST/raw."
        )


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a two-layer head; any square input size (adaptive pooling to 4x4)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, H, W) float32 -> logits (B, 10)
        return self.head(self.features(x))


def probe_step(model: nn.Module, device: torch.device, amp: mixed_precision) -> Callable[[Any], None]:
    """The training step's forward and backward on a copy of ``model``, for tune_loader to time."""
    probe = copy.deepcopy(model)

    def step(batch: list[torch.Tensor]) -> None:
        x, y = to_device(batch, device)
        with amp:
            F.cross_entropy(probe(x), y).backward()

    return step


def threads_arg(text: str) -> int | str:
    """``--threads``: "auto", or a count >= 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {text!r}")
    return int(text)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)  # summed on device, read once
    total = 0
    for batch in loader:
        x, y = to_device(batch, device)  # speedups
        correct += (model(x).argmax(dim=1) == y).sum()
        total += len(y)
    model.train()
    return correct.item() / total  # one sync for the whole evaluation


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--data-root", default="./data", help="where MNIST lives (only with --dataset mnist)")
    parser.add_argument("--download", action="store_true", help="download MNIST if missing")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: this process's device)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--micro-batch-size", default=None, help='rows per forward/backward: an int, or "auto" (found on OOM)'
    )
    parser.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="fp32")
    parser.add_argument("--log-dir", default=None, help="write metrics.csv (and TensorBoard) and curves.png")
    parser.add_argument(
        "--threads", type=threads_arg, default="auto", help='torch compute threads: "auto" (timed) or an int'
    )
    args = parser.parse_args(argv)
    micro = args.micro_batch_size
    micro = int(micro) if micro is not None and micro.isdigit() else micro  # "auto" stays a string

    torch.manual_seed(args.seed)
    # speedups: None -> this process's device (cuda:LOCAL_RANK, else mps, else cpu)
    device = resolve_device(args.device)
    if args.dataset == "digits":
        train_set, test_set = load_digits_split(args.seed)
    else:
        train_set, test_set = load_mnist_split(args.data_root, args.download)
    generator = torch.Generator().manual_seed(args.seed)
    # speedups: pinned memory with CUDA, seeded workers; the tensors are already in memory, so workers would
    # only add copies (tune_loader measures it): num_workers=0. Decoding datasets keep num_workers="auto".
    train_loader = fast_loader(train_set, args.batch_size, shuffle=True, generator=generator, num_workers=0)
    test_loader = fast_loader(test_set, 512, num_workers=0)

    model = to_device(SmallCNN(), device)  # speedups
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    tracker = LossTracker()  # speedups: replaces `losses.append(loss.item())`
    # speedups: autocast for the forward pass; "fp32" is off (a true no-op, as enabled=False)
    amp = mixed_precision(args.precision, device_type=device.type)

    # speedups: backward here, optimizer step every N calls; micro_batch_size splits a batch that does not fit
    @accumulate(args.accumulate, optimizer, micro_batch_size=micro)
    @amp  # speedups: with fp16, @accumulate scales the loss and unscales once per optimizer step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.cross_entropy(model(x), y), len(y)  # mean loss of the micro-batch, and its sample count

    # speedups: split the cores between torch's compute threads and loading, timed with the step on a copy of
    # the model (the RNG states are put back); the tensors are in memory, so the main process loads
    train_loader, report = tune_loader(
        train_loader,
        step=probe_step(model, device, amp),
        candidates=[{"num_workers": 0}],
        num_threads=args.threads,
        max_seconds=2,
        progress=False,
    )
    print(f"tune_loader: num_threads={report.chosen['num_threads']} (was {report.num_threads_before})")

    logger = None
    if args.log_dir is not None:  # speedups: per-update metrics from device tensors, no sync per step
        tensorboard = importlib.util.find_spec("tensorboard") is not None
        logger = MetricLogger(args.log_dir, sinks=["csv", "tensorboard"] if tensorboard else "csv")
        train_step.on_update(logger.log_update)  # loss, lr and items of every optimizer step

    for epoch in range(args.epochs):
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, file=sys.stderr)
        start, seen = time.perf_counter(), 0
        for step, batch in enumerate(bar):
            x, y = to_device(batch, device)  # speedups
            loss, n = train_step(x, y)  # detached loss, on the device
            tracker.update(loss, n)  # speedups: no sync here
            seen += len(y)
            if step == 0 and epoch == 0 and micro is not None:
                rows = train_step.micro_batch_size  # None under "auto" until a batch runs out of memory
                now = f"{rows} rows per micro-batch" if rows else f"whole batches ({len(y)} rows) fit so far"
                print(f"micro_batch_size={micro!r}: {now}")
            if step % 10 == 0:  # reading the tracker is one sync: do it now and then, not every step
                rate = seen / (time.perf_counter() - start)
                if logger is not None:  # the logger's values that have landed: host values, no sync
                    bar.set_postfix(**logger.postfix(), samples_per_s=f"{rate:.0f}")
                else:
                    bar.set_postfix(loss=f"{tracker:.4f}", samples_per_s=f"{rate:.0f}")
        train_step.flush()  # speedups: a short last window is applied now, not carried into the next epoch
        train_loss = tracker.end_epoch()  # one sync per epoch
        accuracy = evaluate(model, test_loader, device)
        print(f"epoch {epoch + 1}: train_loss={train_loss:.4f} test_accuracy={accuracy:.4f}")
        if logger is not None:
            logger.log(train_step.num_updates, train_loss=train_loss, test_accuracy=accuracy)

    if logger is not None:
        logger.close()
        print(f"curves: {plot_metrics(args.log_dir)}")  # speedups: one panel per metric, x = update

    print(f"test_accuracy={accuracy:.4f}")  # the line scripts parse
    return accuracy


if __name__ == "__main__":
    main()

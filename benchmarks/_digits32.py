"""The end-to-end benchmark's task: scikit-learn's digits at 32x32, augmented on the CPU, and a race clock.

Every row of ``benchmarks/end_to_end.py`` trains the same model on the same data to the same test accuracy;
this module holds what they share, so that only the training loops differ.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

SIZE = 32  # the 8x8 digits upscaled to SIZE x SIZE


def _normalize() -> list[nn.Module]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5], [0.5])]


class AugmentedDigits(Dataset):
    """uint8 images (N, 1, 32, 32) augmented per item on the CPU, as a real image pipeline does.

    ``__getitem__`` costs about 0.3 ms of CPU per item (random affine, padded random crop, to float,
    normalise): a ``num_workers=0`` loader spends about as long on it as a small model spends training.
    Module-level (picklable), so workers under any start method can load it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.transform = v2.Compose(
            [
                v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
                v2.RandomCrop(SIZE, padding=2),
                *_normalize(),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]  # (1, 32, 32) float32, () int64


@dataclass
class Task:
    train: AugmentedDigits
    test_x: torch.Tensor  # (M, 1, 32, 32) float32, normalised, not augmented
    test_y: torch.Tensor  # (M,) int64


def load_task(seed: int = 0) -> Task:
    """scikit-learn's digits upscaled to 32x32 once (bilinear), split 80/20 as examples/train_digits.py."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=SIZE, mode="bilinear", align_corners=False)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)  # stored as images are: uint8
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    normalize = v2.Compose(_normalize())
    return Task(
        train=AugmentedDigits(images[train_idx], labels[train_idx]),
        test_x=normalize(images[test_idx]),
        test_y=labels[test_idx],
    )


def make_model() -> nn.Module:
    """Two 3x3 convolutions and a 512-wide head for (B, 1, 32, 32) inputs -> (B, 10) logits (~1.1M params).

    Half of the forward FLOPs are the head's matrix multiply, the kind of work bf16 speeds up on CPUs with
    AVX-512 BF16 / AMX and on GPUs.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 16 x 16
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8 x 8
        nn.Flatten(), nn.Linear(32 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10),
    )  # fmt: skip


@torch.no_grad()
def accuracy(
    model: nn.Module, task: Task, device: torch.device, autocast: AbstractContextManager[object] | None = None
) -> float:
    """Test accuracy in one batch (one host-device sync), under the row's own precision context."""
    was_training = model.training
    model.eval()
    with autocast if autocast is not None else nullcontext():
        logits = model(task.test_x.to(device))
    model.train(was_training)
    return (logits.argmax(dim=1) == task.test_y.to(device)).float().mean().item()


@dataclass
class Outcome:
    """One row's race: seconds to the target (or to ``max_epochs`` when not reached), epochs, accuracy."""

    seconds: float
    epochs: int
    accuracy: float
    reached: bool
    setup: float  # seconds spent before the clock started (tuning, probing, wrapping): not in ``seconds``
    notes: str = ""


class Race:
    """The clock of one row: started when training starts, stopped at the epoch that reaches the target.

    Created when the row begins (so :attr:`setup` measures what the row does before :meth:`start`).
    Evaluation at each epoch end is inside the clock: every row pays for it alike.
    """

    def __init__(self, target: float, max_epochs: int) -> None:
        self.target, self.max_epochs = target, max_epochs
        self.created = time.perf_counter()
        self.began: float | None = None
        self.epochs, self.last = 0, 0.0

    def start(self) -> None:
        self.began = time.perf_counter()

    def epoch_done(self, accuracy: float) -> bool:
        """Record an epoch's test accuracy; True when the row stops (target reached, or out of epochs)."""
        self.epochs += 1
        self.last = accuracy
        if accuracy >= self.target or self.epochs >= self.max_epochs:
            self.stopped = time.perf_counter()
            return True
        return False

    def outcome(self, notes: str = "") -> Outcome:
        assert self.began is not None, "Race.start() was not called"
        return Outcome(
            seconds=self.stopped - self.began,
            epochs=self.epochs,
            accuracy=self.last,
            reached=self.last >= self.target,
            setup=self.began - self.created,
            notes=notes,
        )

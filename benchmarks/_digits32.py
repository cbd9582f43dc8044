"""The end-to-end benchmark's task: scikit-learn's digits as 64x64 PNGs, decoded and augmented on the CPU to
32x32, and a race clock.

Every row of ``benchmarks/end_to_end.py`` trains the same model on the same data to the same test accuracy;
this module holds what they share, so that only the training loops differ.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import Dataset, Sampler
from torchvision.transforms import v2

SIZE = 32  # what the model sees: SIZE x SIZE
STORED = 64  # what is stored: the 8x8 digits upscaled to STORED x STORED, PNG-encoded as image files are


def _normalize() -> list[nn.Module]:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5], [0.5])]


class AugmentedDigits(Dataset):
    """PNG-encoded 64x64 digits, decoded and augmented per item on the CPU, as an image-folder pipeline does.

    ``__getitem__`` decodes the PNG (Pillow), takes a random resized crop to 32x32, a random affine, and
    normalises: 0.6-1.3 ms of CPU per item on the 2-core machines it ran on, of the order of what the model's
    training step costs per sample on one thread (0.6-0.8 ms): a ``num_workers=0`` loop spends about half its
    time loading. The benchmark prints both figures for the machine it runs on.
    Module-level (picklable), so workers under any start method can load it.
    """

    def __init__(self, encoded: list[bytes], labels: torch.Tensor) -> None:
        self.encoded, self.labels = encoded, labels
        self.transform = v2.Compose(
            [
                v2.PILToTensor(),  # (1, 64, 64) uint8: the transforms below run on a plain tensor
                v2.RandomResizedCrop(SIZE, scale=(0.7, 1.0), ratio=(0.9, 1.1), antialias=True),
                v2.RandomAffine(degrees=10, translate=(0.1, 0.1)),
                *_normalize(),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Item ``key % len(self)``, augmented with draws seeded by ``key`` (see :class:`RaceSampler`).

        The seed is set on torch's CPU generator and its state restored after, so the augmentation of a
        key is the same in the main process and in any worker, and nothing else's draws move.
        """
        i = key % len(self.labels)
        rng = torch.default_generator
        state = rng.get_state()
        rng.manual_seed(key)
        try:
            image = self.transform(Image.open(io.BytesIO(self.encoded[i])))  # 64x64 L -> (1, 32, 32) float32
        finally:
            rng.set_state(state)
        return image, self.labels[i]  # () int64


class RaceSampler(Sampler[int]):
    """Every loop's sample order: one permutation per (seed, epoch), as keys that also seed the augmentation.

    Yields ``key = (seed * 1000 + epoch) * N + i`` for a permutation of ``i`` in ``range(N)``;
    :class:`AugmentedDigits` loads item ``key % N`` augmented from ``key``. So every row of the race sees the
    same batches, augmented alike, whatever its ``num_workers``, persistence or library: the rows differ in
    speed, not in data. Call :meth:`set_epoch` at the start of each epoch, as with a ``DistributedSampler``.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        base = (self.seed * 1000 + self.epoch) * self.size
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(base))
        return iter((order + base).tolist())


def encode_png(image: torch.Tensor) -> bytes:
    """A (1, H, W) uint8 image as the bytes of a grayscale PNG file (Pillow)."""
    out = io.BytesIO()
    Image.fromarray(image[0].numpy(), mode="L").save(out, format="PNG")
    return out.getvalue()


@dataclass
class Task:
    train: AugmentedDigits
    test_x: torch.Tensor  # (M, 1, 32, 32) float32, normalised, not augmented
    test_y: torch.Tensor  # (M,) int64

    def sampler(self, seed: int) -> RaceSampler:
        """The sample order of one repetition (``seed``), the same for every row."""
        return RaceSampler(len(self.train), seed)


def load_task(seed: int = 0) -> Task:
    """scikit-learn's digits upscaled to 64x64 (bilinear), PNG-encoded, split 80/20 as the example is.

    The test images are decoded and resized to 32x32 once (not augmented).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=STORED, mode="bilinear", align_corners=False)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)  # (N, 1, 64, 64) uint8
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    test = v2.Compose([v2.Resize(SIZE, antialias=True), *_normalize()])
    return Task(
        train=AugmentedDigits([encode_png(images[i]) for i in train_idx], labels[train_idx]),
        test_x=test(images[test_idx]),
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

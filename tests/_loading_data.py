"""Picklable datasets and worker_init_fns for the loading tests (module level, so spawn can import them)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

# Set in each worker process by record_init; read back through SeedProbe's items.
INIT_MARK: dict[str, int] = {}


class SeedProbe(Dataset):
    """Item i: (i, worker id, worker seed, a numpy draw, a random draw, a torch draw, the init mark)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, int, int, int, int, int]:
        info = get_worker_info()
        wid, seed = (info.id, info.seed) if info is not None else (-1, -1)
        return (
            i,
            wid,
            seed,
            int(np.random.randint(2**31)),
            random.getrandbits(31),
            int(torch.randint(2**31, ())),
            INIT_MARK.get("worker", -1) * 1000 + INIT_MARK.get("draw", 0) % 1000,
        )


def record_init(worker_id: int, offset: int = 100) -> None:
    """A user's worker_init_fn: marks the worker and records a numpy draw made at init time."""
    INIT_MARK["worker"] = offset + worker_id
    INIT_MARK["draw"] = int(np.random.randint(2**31))


def identity_collate(batch: list) -> list:
    return batch


class Squares(Dataset):
    """Item i: the tensor [i, i*i] as float32."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(i * i)])


class Stream(IterableDataset):
    """An iterable dataset yielding 0..n-1 as float32 tensors (no sharding by worker)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor(float(i))


class EpochItems(Dataset):
    """Item i: (i, the epoch set in the main process by set_epoch): per-epoch dataset state."""

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, self.epoch])


class Noisy(Dataset):
    """``n`` fixed rows of 6 inputs (seed 1) plus noise drawn in ``__getitem__`` (seeded per sample by the
    loader), and targets of 1 dim times ``scale``: a regression every layout sees alike."""

    def __init__(self, n: int, scale: float = 1.0) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 6, generator=g), scale * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


class Augmented(Dataset):
    """Item i: a (5,) float64 row: i, then random "augmentation" drawn from torch, random and numpy."""

    def __init__(self, n: int = 24) -> None:
        self.n = n
        self.classes = ["a", "b"]  # an attribute the loop reads through loader.dataset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        draws = [torch.rand(()).item(), random.random(), float(np.random.rand()), torch.randn(()).item()]
        return torch.tensor([float(i), *draws], dtype=torch.float64)


class AugmentedImages(Dataset):
    """Item i: an (8, 8) image, flipped and cropped at random by torchvision v2 transforms, and its index."""

    def __init__(self, n: int = 16) -> None:
        from torchvision.transforms import v2

        self.images = torch.arange(n * 64, dtype=torch.float32).reshape(n, 1, 8, 8)
        self.transform = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomResizedCrop(6, antialias=True)])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[i]), i


class Costly(Dataset):
    """Items that take ``ms`` milliseconds each, waiting (on a disk or the network) rather than computing.
    Item i is a (4,) float32 row of i."""

    def __init__(self, ms: float, n: int = 100_000) -> None:
        self.seconds, self.n = ms / 1000, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.full((4,), float(i))


class LateDraws(Dataset):
    """Item i: (i, a torch draw, then a ``random`` draw only for i >= ``late``)."""

    def __init__(self, n: int = 24, late: int = 12) -> None:
        self.n, self.late = n, late

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        late = random.random() if i >= self.late else -1.0
        return torch.tensor([float(i), torch.rand(()).item(), late], dtype=torch.float64)


class EpochProbe(SeedProbe):
    """SeedProbe's item (index, worker id, worker seed, numpy, random and torch draws, init mark), then the
    pid of the process that loaded it (which a fresh-worker reference does not share)."""

    def __getitem__(self, i: int) -> tuple[int, ...]:  # type: ignore[override]
        return (*super().__getitem__(i), os.getpid())


class BatchedProbe(EpochProbe):
    """An EpochProbe with a ``__getitems__`` of its own (marked: its items' init mark is negated)."""

    def __getitems__(self, indices: list[int]) -> list[tuple[int, ...]]:
        assert type(indices) is list and all(isinstance(i, int) for i in indices), indices
        out = []
        for i in indices:
            item = self[i]
            out.append((*item[:6], -1 - item[6], item[7]))
        return out


class EagerShuffle(Sampler):
    """A sampler that draws its whole permutation from the global torch RNG when ``iter()`` is called (not at
    its first index, as RandomSampler does): the order of draws a fresh DataLoader iterator makes shows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class EagerBatches(EagerShuffle):
    """A batch sampler that draws its permutation at ``iter()``, in batches of 3."""

    def __len__(self) -> int:
        return -(-self.n // 3)

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        return iter([order[i : i + 3] for i in range(0, self.n, 3)])

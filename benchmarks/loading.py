"""Tips 1-2 benchmark: batches/s with 0 workers, a manual grid of worker counts, and tune_loader's choice.

The dataset's ``__getitem__`` costs about 1 ms of CPU work (decompress an image, random crop and flip, a
per-pixel jitter loop: decode-and-augment style); the model is light (one linear layer, SGD), so loading is
the bottleneck, as it is for a GPU fed by a CPU pipeline. Every variant runs whole epochs of the same
shuffled data with the same training step, interleaved round-robin in one run (benchmarks/_timing.py).

    python -m benchmarks.loading            # full run, writes benchmarks/results/loading.png
    python -m benchmarks.loading --quick    # a few seconds: smoke mode, small sizes, no chart

Targets on 2 cores: the tuned loader >= 0.9x the best of the grid and >= 1.7x the num_workers=0 loader.
Per-sample seeds (``fast_loader(..., sample_seeds=True)``) cost at most 1.02x per item: the same loader with
and without them, loading alone in this process (0 workers), so the ratio is the cost per item; once with
augmentation drawn from torch's RNG (as torchvision's transforms draw), once from torch, random and numpy.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups import fast_loader, tune_loader

SIDE = 32


class DecodeAugment(Dataset):
    """Items are (3, 32, 32) float32 images and an int64 label; each costs about ``ms`` of CPU work.

    ``draws="item"``: the crop and flip come from a generator seeded by the index (every loader yields the
    same data); ``"torch"``: from torch's global RNG, as torchvision's transforms draw; ``"all"``: also one
    draw each from ``random`` and numpy's global RNG.
    """

    def __init__(self, n: int, ms: float = 1.0, draws: str = "item") -> None:
        self.draws = draws
        rng = np.random.default_rng(0)
        raw = rng.integers(0, 256, size=(3, SIDE + 4, SIDE + 4), dtype=np.uint8)
        self.blob = zlib.compress(raw.tobytes(), 6)
        self.n = n
        # calibrate the per-pixel loop so one item costs about `ms` milliseconds on this machine
        self.jitter = 2000
        start = time.perf_counter()
        for i in range(20):
            self[i]
        per_item = (time.perf_counter() - start) / 20
        self.jitter = max(1, int(self.jitter * (ms / 1000) / per_item))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = np.frombuffer(zlib.decompress(self.blob), dtype=np.uint8).reshape(3, SIDE + 4, SIDE + 4)
        if self.draws == "item":
            rng = np.random.default_rng(i)  # deterministic per item: every loader yields the same data
            y, x = rng.integers(0, 5, size=2)
            flip = rng.random() < 0.5
        else:
            y, x = torch.randint(0, 5, (2,)).tolist()
            flip = bool(torch.rand(()) < 0.5)
            if self.draws == "all":
                flip ^= random.random() < 0.5
                flip ^= bool(np.random.rand() < 0.5)
        img = img[:, y : y + SIDE, x : x + SIDE]
        if flip:
            img = img[:, :, ::-1]
        flat = img.reshape(-1)
        acc = 0
        for k in range(self.jitter):  # per-pixel Python work, as a pure-Python augmentation would do
            acc = (acc * 31 + int(flat[k % flat.size])) & 0xFFFF
        out = torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32) / 255.0)
        return out, int(acc % 10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds, no chart")
    args = parser.parse_args(argv)

    quick = args.quick
    # The light model runs on one thread in the main process, as a GPU job's main process mostly waits:
    # idle intra-op threads would otherwise spin on the cores the workers need (all variants alike).
    torch.set_num_threads(1)
    items, batch, rounds = (64, 16, 1) if quick else (768, 32, 5)
    ms = 0.2 if quick else 1.0
    grid = [1, 2] if quick else [1, 2, 3, 4]
    dataset = DecodeAugment(items, ms=ms)
    model = nn.Linear(3 * SIDE * SIDE, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def loader(workers: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(0),
        )

    started = time.perf_counter()
    base = fast_loader(dataset, batch, shuffle=True, seed=0)  # num_workers="auto", persistent workers
    tuned, report = tune_loader(base, max_seconds=2 if quick else 20, progress=False)
    tune_seconds = time.perf_counter() - started
    print(report)
    print(f"tune_loader took {tune_seconds:.1f} s")

    loaders = {"num_workers=0": loader(0)}
    loaders.update({f"num_workers={w}": loader(w) for w in grid})
    loaders["tune_loader"] = tuned

    def epoch(dl: DataLoader) -> None:
        for x, y in dl:
            loss = F.cross_entropy(model(x.flatten(1)), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    batches = len(loaders["num_workers=0"])
    seconds = compare({name: (lambda dl=dl: epoch(dl)) for name, dl in loaders.items()}, rounds=rounds)
    print(
        ratio_table(
            f"seconds per epoch ({batches} batches of {batch}, ~{ms} ms/item)", seconds, "num_workers=0"
        )
    )

    rates = {name: batches / s for name, s in seconds.items()}
    best_name = max((n for n in rates if n.startswith("num_workers=")), key=rates.__getitem__)
    print(f"\n{'variant':<14}  {'batches/s':>9}  vs num_workers=0")
    for name, rate in rates.items():
        print(f"{name:<14}  {rate:>9.1f}  {rate / rates['num_workers=0']:>6.2f}x")
    chosen = report.chosen["num_workers"]
    vs_best = rates["tune_loader"] / rates[best_name]
    vs_zero = rates["tune_loader"] / rates["num_workers=0"]
    print(
        f"\ntune_loader chose num_workers={chosen}: {vs_best:.2f}x the best of the grid ({best_name}, "
        f"target >= 0.9x), {vs_zero:.2f}x num_workers=0 (target >= 1.7x on 2 cores)"
    )
    for draws in ("torch", "all"):  # torchvision's transforms draw from torch; some pipelines from all three
        augmenting = DecodeAugment(items, ms=ms, draws=draws)
        _sample_seeds_cost(augmenting, batch, rounds=2 if quick else 15)
    if not quick:
        path = save_chart(
            RESULTS / "loading.png",
            "batches/s relative to num_workers=0",
            {n: r / rates["num_workers=0"] for n, r in rates.items()},
            ylabel="speed-up",
        )
        print(f"chart: {path}")


def _sample_seeds_cost(dataset: DecodeAugment, batch: int, rounds: int) -> None:
    """Print the per-item cost of sample_seeds=True: the same epochs loaded in this process with and without.

    Loading runs in this process (0 workers), so its CPU time (``time.process_time``, which leaves out the
    time other tenants of a shared machine take) is the whole cost. Both loaders read the same order (a
    one-rank ``DistributedSampler``, as ``sample_seeds=True`` orders) and take turns batch by batch, the
    first of each pair alternating; the median over all pairs of the ratio of their times is printed (a
    burst of someone else's work moves a pair, rarely the median).
    """
    seeded = fast_loader(dataset, batch, shuffle=True, seed=0, num_workers=0, sample_seeds=True)
    order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    plain = fast_loader(dataset, batch, sampler=order, num_workers=0)

    def timed_next(it: Iterator[Any]) -> float:
        start = time.process_time()
        next(it)
        return time.process_time() - start

    ratios, totals = [], [0.0, 0.0]
    for r in range(rounds + 1):  # the first round warms up
        order.set_epoch(r)
        its = [iter(plain), iter(seeded)]
        for b in range(len(plain)):
            spent = [0.0, 0.0]
            for k in (0, 1) if b % 2 else (1, 0):
                spent[k] = timed_next(its[k])
            if r:
                ratios.append(spent[1] / spent[0])
                totals = [totals[0] + spent[0], totals[1] + spent[1]]
    items = len(dataset) * rounds
    seconds = {"fast_loader": totals[0] / rounds, "sample_seeds=True": totals[1] / rounds}
    print()
    title = f"CPU seconds per epoch loaded in the main process (0 workers), draws from {dataset.draws}"
    print(ratio_table(title, seconds, "fast_loader"))
    extra_us = (totals[1] - totals[0]) / items * 1e6
    print(
        f"sample_seeds=True ({dataset.draws}): {statistics.median(ratios):.3f}x per item, the median of "
        f"{len(ratios)} batch pairs ({extra_us:+.1f} us per item overall; target <= 1.02x)"
    )


if __name__ == "__main__":
    main()

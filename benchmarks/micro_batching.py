"""Benchmark: what ``micro_batch_size=M`` costs against a hand-written chunk loop on the same split.

An MLP (256-512-512-10), batches of 256 rows split into micro-batches of 64, accumulation over 2 batches,
one CPU thread, no out of memory. Variants, timed round-robin in the same run: the hand-written loop that
splits each batch with ``x.split(M)`` and weighs each chunk by its rows, the same work through
``micro_batch_size=M``; and, for the cost of ``"auto"`` when nothing runs out of memory (whole batches, the
gradients set aside and added back on the second call of each window), a hand-written whole-batch loop and
``micro_batch_size="auto"``. The target: ``micro_batch_size=M`` within 1.03x of the chunk loop.

    python -m benchmarks.micro_batching            # about a minute
    python -m benchmarks.micro_batching --quick    # a few seconds, for the smoke test
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups.accumulation import accumulate

EVERY = 2
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _setup(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def hand_written(batches: Batches, width: int, micro: int | None) -> Callable[[], None]:
    model, opt = _setup(width)

    def epoch() -> None:
        for i, (x, y) in enumerate(batches):
            rows = len(x)
            chunks = zip(x.split(micro), y.split(micro), strict=True) if micro else [(x, y)]
            for xc, yc in chunks:
                loss = F.cross_entropy(model(xc), yc) * (len(xc) / rows / EVERY)
                loss.backward()
            if (i + 1) % EVERY == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return epoch


def with_micro_batching(batches: Batches, width: int, micro: int | str) -> Callable[[], None]:
    model, opt = _setup(width)

    @accumulate(EVERY, opt, micro_batch_size=micro)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def epoch() -> None:
        for x, y in batches:
            train_step(x, y)

    return epoch


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds: a smoke run")
    parser.add_argument("--batches", type=int, default=16, help="batches per timed epoch")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    n, rounds, width = (2, 2, 64) if args.quick else (args.batches, args.rounds, 512)
    rows, micro = 256, 64

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g)) for _ in range(n)
    ]
    variants = {
        f"hand-written chunks of {micro}": hand_written(batches, width, micro),
        f"micro_batch_size={micro}": with_micro_batching(batches, width, micro),
        "hand-written whole batch": hand_written(batches, width, None),
        'micro_batch_size="auto" (no OOM)': with_micro_batching(batches, width, "auto"),
    }
    seconds = compare(variants, rounds=rounds, warmup=1)
    title = (
        f"micro-batching: MLP 256-{width}-{width}-10, batch {rows} in micro-batches of {micro}, "
        f"accumulate({EVERY}), "
        f"{n} batches per epoch, 1 thread, median of {rounds} rounds"
    )
    base = f"hand-written chunks of {micro}"
    print(ratio_table(title, seconds, base))
    auto = seconds['micro_batch_size="auto" (no OOM)'] / seconds["hand-written whole batch"]
    print(f'micro_batch_size="auto" against the hand-written whole-batch loop: {auto:.3f}x')
    ratios = {name: s / seconds[base] for name, s in seconds.items()}
    if not args.quick:
        print(f"chart: {save_chart(RESULTS / 'micro_batching.png', title.split(':')[0], ratios)}")
    return ratios


if __name__ == "__main__":
    main()

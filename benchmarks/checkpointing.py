"""Benchmark: how long a checkpoint save stalls the training loop, synchronous against ``background=True``.

A model of about 200 MB (12 fp32 linear layers of 2048 x 2048), saved with ``save_checkpoint`` to a file in a
temporary directory on the same disk as the repository's, round-robin in the same run:

- synchronous: the call returns once the file is written, flushed to disk and renamed into place;
- background: the call returns once rank 0 holds a copy of the state in host memory; a thread writes the
  file (the write is waited for after the timed call, untimed, before the next round).

It prints the median stall of each and one line
``checkpointing: background save stalls the loop X.XXx of a synchronous save`` (target: at most 0.25x on the
CPU), and how long the background write itself took.

    python -m benchmarks.checkpointing            # about a minute
    python -m benchmarks.checkpointing --quick    # a small model, for the smoke test
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks._timing import ROOT
from speedups import save_checkpoint
from speedups.checkpoint import background


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4 MB model and 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    layers, width, rounds = (4, 512, 2) if args.quick else (12, 2048, args.rounds)
    torch.set_num_threads(1)
    model = model_of(layers, width)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    stalls: dict[str, list[float]] = {"synchronous": [], "background": []}
    writes: list[float] = []
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:
        path = Path(folder) / "ckpt.pt"
        save_checkpoint(path, model=model)  # warm-up: the file exists, as it does in a running job
        for _ in range(rounds):
            for name in stalls:
                start = time.perf_counter()
                save_checkpoint(path, model=model, background=name == "background")
                stalls[name].append(time.perf_counter() - start)
                background.wait()
                if name == "background":
                    writes.append(time.perf_counter() - start)
                with torch.no_grad():  # the loop goes on: the next save holds other values
                    for p in model.parameters():
                        p.add_(1e-3)
    sync, bg = (statistics.median(stalls[name]) for name in ("synchronous", "background"))
    print(f"model: {layers} x Linear({width}, {width}), {megabytes:.0f} MB; median of {rounds} rounds")
    print(f"  synchronous save:  {sync * 1e3:8.1f} ms stall")
    print(
        f"  background save:   {bg * 1e3:8.1f} ms stall (the write itself: {statistics.median(writes):.2f} s)"
    )
    ratio = bg / sync
    print(f"checkpointing: background save stalls the loop {ratio:.2f}x of a synchronous save")
    return ratio


if __name__ == "__main__":
    main()

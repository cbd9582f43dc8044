"""Benchmark: compile time and step time of a transformer compiled whole against its blocks compiled.

A GPT-style model of 12 identical blocks (pre-norm attention and MLP, width 128, 4 heads, sequence 64,
batch 8) trained with AdamW on the CPU with inductor. Two ways of compiling, each in a fresh process so no
compiled code or cache is shared (inductor's on-disk caches are pointed at an empty directory per process):

- whole: ``torch.compile(model)``, the usual way;
- blocks: ``compile_blocks(model, "blocks.*")``, PyTorch's regional compilation: one block compiled, its
  code reused by the other eleven (and the embedding, final norm and head eager).

Cold compile time is the first training step's wall time (trace, lower, C++ build) minus a warm step's; step
time is the median of the steps after two warm-up steps, eager beside them in the same process for the ratio.
The line: ``compile: blocks compile X.Xx faster than the whole model; step Y.YYx of the whole model's``.

    python -m benchmarks.compile            # a few minutes on 2 cores (two cold inductor compiles)
    python -m benchmarks.compile --quick    # 4 blocks, fewer steps
    python -m benchmarks.compile --quick --backend aot_eager   # seconds: the smoke test (no C++ build)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks._gpt import GPT

ROOT = Path(__file__).resolve().parent.parent


def _one(way: str, depth: int, steps: int, backend: str = "inductor") -> dict[str, float]:
    """In this process: the first step's time and the median step time of ``way`` and of eager."""
    from speedups import compile_blocks

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = GPT(depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (8, 64), generator=g)
    target = torch.randint(0, 256, (8, 64), generator=g)

    def step(forward) -> float:
        start = time.perf_counter()
        loss = F.cross_entropy(forward(idx).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    eager = [step(model) for _ in range(2 + steps)][2:]
    if way == "whole":
        forward = torch.compile(model, backend=backend)
    else:
        forward = compile_blocks(model, "blocks.*", backend=backend)
    first = step(forward)
    times = [step(forward) for _ in range(2 + steps)][2:]
    warm = statistics.median(times)
    return {"compile_s": first - warm, "step_s": warm, "eager_step_s": statistics.median(eager)}


def _fresh(way: str, depth: int, steps: int, backend: str) -> dict[str, float]:
    """:func:`_one` in a new process with empty inductor caches."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache)
        code = (
            f"import json; from benchmarks.compile import _one; "
            f"print(json.dumps(_one({way!r}, {depth}, {steps}, {backend!r})))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        raise RuntimeError(f"benchmarks.compile ({way}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, few steps, for the smoke test")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile's backend (the smoke test: aot_eager)"
    )
    args = parser.parse_args(argv)
    depth, steps = (4, 3) if args.quick else (12, 10)
    found = {way: _fresh(way, depth, steps, args.backend) for way in ("whole", "blocks")}
    whole, blocks = found["whole"], found["blocks"]
    print(f"GPT, {depth} blocks (width 128, 4 heads, sequence 64, batch 8), AdamW, CPU {args.backend}, "
          f"torch {torch.__version__}")  # fmt: skip
    print("| compiled | cold compile (s) | step (ms) | step vs eager |")
    print("|---|---|---|---|")
    for way, row in found.items():
        print(f"| {way} | {row['compile_s']:.1f} | {1e3 * row['step_s']:.1f} | "
              f"{row['step_s'] / row['eager_step_s']:.2f}x |")  # fmt: skip
    faster, step = whole["compile_s"] / blocks["compile_s"], blocks["step_s"] / whole["step_s"]
    print(
        f"compile: blocks compile {faster:.1f}x faster than the whole model; "
        f"step {step:.2f}x of the whole model's"
    )
    return found


if __name__ == "__main__":
    main()

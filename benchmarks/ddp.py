"""Benchmark: data-parallel throughput, 1 process vs 2 processes (torchrun, gloo, one thread each).

A compute-bound MLP trains for a fixed number of steps with the same per-rank batch; each variant reports
samples per second measured inside the job (after a warm-up, between barriers), so process start-up is not
counted. Variants run round-robin in the same run; the table gives time per sample and its ratio to one
process (lower is faster), the speedup is 1 / ratio. Target: >= 1.7x with 2 processes on 2 CPU cores.

    python -m benchmarks.ddp            # a few rounds, chart in benchmarks/results/ddp.png
    python -m benchmarks.ddp --quick    # a smoke run: tiny model, one round

On GPUs, run the worker directly under torchrun: one process per GPU (nccl), e.g.
``torchrun --nproc-per-node 8 -m benchmarks.ddp --worker --steps 200 --width 8192``, and on two nodes
``torchrun --nnodes 2 --node-rank $i --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29400
-m benchmarks.ddp --worker ...``; compare the printed samples/s with ``--nproc-per-node 1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(steps: int, width: int, batch: int) -> None:
    """Train ``steps`` steps of an MLP under ddp_wrap; print ``samples_per_s=<float>`` on rank 0."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from speedups import ddp_wrap, rank_zero_print, seed_everything

    torch.set_num_threads(1)
    seed_everything(0)
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)]
    model = ddp_wrap(nn.Sequential(*layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    if world > 1:
        torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if world > 1:
        torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    rank_zero_print(f"samples_per_s={steps * batch * world / elapsed:.2f}")


def _launch(nproc: int, args: list[str]) -> float:
    sys.path.insert(0, str(ROOT))
    from tests._dist import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if nproc == 1:
        cmd = [sys.executable, "-m", "benchmarks.ddp", "--worker", *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "benchmarks.ddp", "--worker", *args,
        ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    line = [s for s in out.stdout.splitlines() if s.startswith("samples_per_s=")][-1]
    return float(line.split("=")[1])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny model, one round")
    parser.add_argument("--worker", action="store_true", help="run one job's training (under torchrun)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (5 if args.quick else 30)
    width = args.width or (64 if args.quick else 1024)
    batch = args.batch or (16 if args.quick else 1024)  # compute-bound: the all-reduce is a small share
    if args.worker:
        from speedups import destroy_distributed

        worker(steps, width, batch)
        destroy_distributed()  # after worker() returned: its DDP model is gone first
        return {}
    rounds = args.rounds or (1 if args.quick else 3)
    job = ["--steps", str(steps), "--width", str(width), "--batch", str(batch)]
    rates: dict[str, list[float]] = {"1 process": [], "2 processes (DDP)": []}
    for _ in range(rounds):  # round-robin, so load from other users hits both variants alike
        rates["1 process"].append(_launch(1, job))
        rates["2 processes (DDP)"].append(_launch(2, job))
    per_sample = {name: 1.0 / statistics.median(r) for name, r in rates.items()}
    from benchmarks._timing import RESULTS, ratio_table, save_chart

    print(ratio_table(f"DDP throughput, MLP width {width}, batch {batch}/rank, {steps} steps", per_sample,
                      "1 process", unit="s/sample"))  # fmt: skip
    speedup = {name: per_sample["1 process"] / value for name, value in per_sample.items()}
    for name, r in rates.items():
        print(f"{name}: median {statistics.median(r):.1f} samples/s over {len(r)} round(s), "
              f"speedup {speedup[name]:.2f}x")  # fmt: skip
    if not args.quick:
        save_chart(RESULTS / "ddp.png", "DDP speedup over 1 process (higher is better)", speedup,
                   ylabel="speedup")  # fmt: skip
    return speedup


if __name__ == "__main__":
    main()

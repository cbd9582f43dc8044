"""Benchmark: how long a checkpoint save stalls the training loop, synchronous against ``background=True``.

A model of about 200 MB (12 fp32 linear layers of 2048 x 2048), saved with ``save_checkpoint`` to a file in a
temporary directory on the same disk as the repository's, round-robin in the same run:

- synchronous: the call returns once the file is written, flushed to disk and renamed into place;
- background: the call returns once rank 0 holds a copy of the state in host memory; a thread writes the
  file (the write is waited for after the timed call, untimed, before the next round).

It prints the median stall of each and one line
``checkpointing: background save stalls the loop X.XXx of a synchronous save`` (target: at most 0.25x on the
CPU), and how long the background write itself took.

Then the same model as FSDP2 on 2 gloo processes (torchrun, one thread each; every layer ``fully_shard``ed,
each rank holding half), saved as a directory by ``torch.distributed.checkpoint``: blocking against
``background=True`` (DCP's ``async_save``: the call returns once each rank's shards are copied to host
memory; DCP's thread writes them). The stall is the slower rank's; one line
``checkpointing: FSDP2 background save stalls the loop X.XXx of a blocking one`` (target: at most 0.25x).

    python -m benchmarks.checkpointing            # about a minute
    python -m benchmarks.checkpointing --quick    # a small model, for the smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
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


def _stalls(
    save: object, model: nn.Module, rounds: int, names: tuple[str, str]
) -> tuple[dict[str, list[float]], list[float]]:
    """Seconds each ``save(background)`` call held the loop, round-robin (``names``: the blocking save's, the
    background one's), and how long each background write took in all; the write is waited for (untimed)
    after each call, and the weights move between saves, as the loop's do."""
    stalls: dict[str, list[float]] = {name: [] for name in names}
    writes: list[float] = []
    for _ in range(rounds):
        for name in names:
            start = time.perf_counter()
            save(name == names[1])  # type: ignore[operator]
            stalls[name].append(time.perf_counter() - start)
            background.wait()
            if name == names[1]:
                writes.append(time.perf_counter() - start)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
    return stalls, writes


def fsdp2_worker(layers: int, width: int, rounds: int, folder: str) -> None:
    """One rank of the FSDP2 part (under torchrun): prints the slower rank's median stalls."""
    from torch.distributed.fsdp import fully_shard

    from speedups import destroy_distributed, init_distributed

    init_distributed()
    torch.set_num_threads(1)
    model = model_of(layers, width)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    path = Path(folder) / "fsdp2"
    save_checkpoint(path, model=model)  # warm-up: the directory exists, as it does in a running job
    save_checkpoint(path, model=model, background=True)  # warm-up: DCP's gloo group made once
    background.wait()

    def save(in_background: bool) -> None:
        save_checkpoint(path, model=model, background=in_background)

    stalls, _ = _stalls(save, model, rounds, ("blocking", "background"))
    medians = torch.tensor([statistics.median(stalls[name]) for name in ("blocking", "background")])
    torch.distributed.all_reduce(medians, op=torch.distributed.ReduceOp.MAX)
    if torch.distributed.get_rank() == 0:
        print(f"fsdp2_stalls={medians[0].item():.6f},{medians[1].item():.6f}", flush=True)
    destroy_distributed()


def _fsdp2(layers: int, width: int, rounds: int, folder: str) -> tuple[float, float]:
    """Run :func:`fsdp2_worker` on 2 gloo processes; the slower rank's median (blocking, background)."""
    sys.path.insert(0, str(ROOT))
    from tests._dist import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "benchmarks.checkpointing",
        "--fsdp2-worker", f"{layers},{width},{rounds},{folder}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    line = [s for s in out.stdout.splitlines() if s.startswith("fsdp2_stalls=")][-1]
    blocking, in_background = (float(v) for v in line.split("=")[1].split(","))
    return blocking, in_background


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4 MB model and 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--fsdp2-worker", help=argparse.SUPPRESS)  # one rank of the FSDP2 part
    args = parser.parse_args(argv)
    if args.fsdp2_worker:
        layers, width, rounds, folder = args.fsdp2_worker.split(",", 3)
        fsdp2_worker(int(layers), int(width), int(rounds), folder)
        return 0.0
    layers, width, rounds = (4, 512, 2) if args.quick else (12, 2048, args.rounds)
    torch.set_num_threads(1)
    model = model_of(layers, width)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:
        path = Path(folder) / "ckpt.pt"
        save_checkpoint(path, model=model)  # warm-up: the file exists, as it does in a running job

        def save(in_background: bool) -> None:
            save_checkpoint(path, model=model, background=in_background)

        stalls, writes = _stalls(save, model, rounds, ("synchronous", "background"))
        blocking, in_background = _fsdp2(layers, width, rounds, folder)
    sync, bg = (statistics.median(stalls[name]) for name in ("synchronous", "background"))
    print(f"model: {layers} x Linear({width}, {width}), {megabytes:.0f} MB; median of {rounds} rounds")
    print(f"  synchronous save:  {sync * 1e3:8.1f} ms stall")
    print(
        f"  background save:   {bg * 1e3:8.1f} ms stall (the write itself: {statistics.median(writes):.2f} s)"
    )
    ratio = bg / sync
    print(f"checkpointing: background save stalls the loop {ratio:.2f}x of a synchronous save")
    print(f"FSDP2 on 2 gloo processes (each rank half the model), the slower rank's median of {rounds}:")
    print(f"  blocking save:     {blocking * 1e3:8.1f} ms stall")
    print(f"  background save:   {in_background * 1e3:8.1f} ms stall (DCP's async_save)")
    fsdp2 = in_background / blocking
    print(f"checkpointing: FSDP2 background save stalls the loop {fsdp2:.2f}x of a blocking one")
    return ratio


if __name__ == "__main__":
    main()

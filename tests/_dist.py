"""Launch real multi-process jobs for tests: torchrun on 127.0.0.1 with the gloo backend.

Worker scripts live in ``tests/workers/`` as plain module-level scripts (no decorated functions: a
wrapt-wrapped function cannot be pickled). Every launch has a hard timeout and a fresh free port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:  # torch.distributed does not import its fsdp package by itself
    import torch.distributed.fsdp as _fsdp
except ImportError:  # a torch built without distributed
    _fsdp = None  # type: ignore[assignment]
HAS_FSDP2 = hasattr(_fsdp, "fully_shard")
"""FSDP2 (``torch.distributed.fsdp.fully_shard``) is public from torch 2.6; older torch skips its tests."""
FSDP2_REASON = "FSDP2 (torch.distributed.fsdp.fully_shard) is public from torch 2.6"

WORKERS = Path(__file__).resolve().parent / "workers"


def say(line: str) -> None:
    """Print one result line from a worker in a single write, so that lines of ranks sharing one pipe never
    interleave (``print`` writes the text and the newline separately)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def count_all_reduces(ddp: Any) -> list[int]:
    """Register a comm hook on a ``DistributedDataParallel`` model that counts its bucket all-reduces (and
    does them as DDP's default hook does); return the one-element counter, read as ``calls[0]``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: DDP checks them
        calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    return calls


def distances(model: Any, ref: Any) -> tuple[float, float]:
    """In a 2-rank job: the largest distance of this rank's parameters to the reference's, and between the
    two ranks' parameters (one all-gather: every rank must call it)."""
    import torch
    import torch.distributed as dist

    def flat(module: Any) -> torch.Tensor:  # FSDP2 parameters are DTensors: compare them whole
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
        return torch.cat([p.detach().reshape(-1) for p in full])

    params, ref_params = flat(model), flat(ref)
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return (params - ref_params).abs().max().item(), (gathered[0] - gathered[1]).abs().max().item()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def torchrun_command(
    script: Path | str, args: Sequence[str] = (), *, nproc: int = 2, extra_launcher_args: Sequence[str] = ()
) -> list[str]:
    """The command line of a single-node torchrun on 127.0.0.1 with a free port."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        *extra_launcher_args, str(script), *args,
    ]  # fmt: skip


def run_torchrun(
    script: Path | str,
    args: Sequence[str] = (),
    *,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    extra_launcher_args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --nproc-per-node nproc script args`` on 127.0.0.1 (TimeoutExpired past timeout)."""
    return subprocess.run(
        torchrun_command(script, args, nproc=nproc, extra_launcher_args=extra_launcher_args),
        cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def run_two_nodes(
    script: Path | str,
    args: Sequence[str] = (),
    *,
    nproc_per_node: int = 1,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Two torchrun "nodes" on localhost (``--nnodes 2``, c10d rendezvous on 127.0.0.1), run together."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "speedups-test",
            "--local-addr", "127.0.0.1",
            str(script), *args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results

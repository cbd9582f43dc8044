"""``python -m speedups.doctor``: what this machine offers each tip, in one screen.

Prints torch and CUDA versions, GPU names and memory, bf16/fp16 support, the CPUs this process may use,
the distributed backends available, and what that means for each tip. Reads only; changes nothing.
"""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch

from speedups._helpers import env
from speedups._helpers.hardware import cpu_has_native_bf16, cpus_per_process, gpu_has_native_bf16, usable_cpus

__all__ = ["diagnose", "format_diagnosis", "main"]


def diagnose() -> dict[str, Any]:
    """Collect the facts the tips depend on, as plain Python values (no side effects, no GPU work).

    Returns:
        A dict with keys ``python``, ``torch``, ``cuda`` (version or None), ``gpus`` (list of dicts with
        ``name``, ``memory_gib``, ``bf16``), ``mps``, ``cpu_capability``, ``cpu_native_bf16``,
        ``usable_cpus``, ``auto_workers`` (what ``fast_loader(num_workers="auto")`` picks),
        ``distributed_backends`` (list of names), ``rank``, ``local_rank``, ``world_size``.
    """
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}",
                    "bf16": gpu_has_native_bf16(i),
                }
            )
    backends = []
    if torch.distributed.is_available():
        for name in ("gloo", "nccl", "mpi", "ucc"):
            probe = getattr(torch.distributed, f"is_{name}_available", None)
            if probe is not None and probe():
                backends.append(name)
    mps = getattr(torch.backends, "mps", None)
    cpu_capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpus": gpus,
        "mps": bool(mps is not None and mps.is_available()),
        "cpu_capability": cpu_capability,
        "cpu_native_bf16": cpu_has_native_bf16(),
        "usable_cpus": usable_cpus(),
        "auto_workers": cpus_per_process(),
        "distributed_backends": backends,
        "rank": env.rank(),
        "local_rank": env.local_rank(),
        "world_size": env.world_size(),
    }


def format_diagnosis(d: dict[str, Any]) -> str:
    """Turn :func:`diagnose`'s dict into the report ``python -m speedups.doctor`` prints."""
    lines = [
        "speedups doctor",
        f"  python {d['python']} on {d['platform']}",
        f"  torch {d['torch']}, CUDA {d['cuda'] or 'not available'}",
    ]
    for i, g in enumerate(d["gpus"]):
        lines.append(
            f"  cuda:{i} {g['name']} ({g['memory_gib']} GiB, compute {g['capability']}, "
            f"bf16 {'yes' if g['bf16'] else 'no'})"
        )
    if not d["gpus"]:
        lines.append("  no CUDA GPU" + (" (MPS available)" if d["mps"] else ""))
    lines += [
        f"  CPU: {d['usable_cpus']} usable by this process, {d['cpu_capability']}, "
        f"native bf16 {'yes' if d['cpu_native_bf16'] else 'no'}",
        f"  distributed backends: {', '.join(d['distributed_backends']) or 'none'}; "
        f"this process is rank {d['rank']} of {d['world_size']} (local rank {d['local_rank']})",
        "",
        "What that means for each tip:",
    ]
    workers = d["auto_workers"]
    lines.append(
        f"  1-2 loaders: fast_loader's num_workers='auto' gives {workers} worker process(es) per training "
        f"process here; tune_loader measures which count is fastest."
    )
    lines.append(
        "  3   batch size: find_batch_size probes "
        + ("GPU memory." if d["gpus"] else "CPU memory (an OOM on CPU may be the OS killing the process).")
    )
    lines.append("  4-6 accumulate, LossTracker, to_device: apply everywhere.")
    if d["gpus"] and all(g["bf16"] for g in d["gpus"]):
        precision = "bf16 autocast on the GPU (no loss scaling needed)."
    elif d["gpus"]:
        precision = "fp16 autocast with loss scaling (this GPU has no fast bf16)."
    elif d["cpu_native_bf16"]:
        precision = "bf16 autocast on this CPU (native bf16)."
    else:
        precision = "none: this CPU has no native bf16, so mixed_precision('auto') stays in fp32."
    lines.append(f"  7   mixed precision: {precision}")
    if len(d["gpus"]) > 1:
        shard = f"{len(d['gpus'])} GPUs: shard_model can split a model across them."
    else:
        shard = "one device: shard_model only helps with more than one GPU."
    lines.append(f"  8   model parallel: {shard}")
    backend = "nccl" if d["gpus"] and "nccl" in d["distributed_backends"] else "gloo"
    lines.append(f"  9   multi-process: torchrun with the {backend} backend.")
    lines.append("  10  profile_steps() shows where each step's time goes.")
    return "\n".join(lines)


def main() -> int:
    """Print the diagnosis; return the exit status (0)."""
    print(format_diagnosis(diagnose()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

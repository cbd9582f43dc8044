"""What this machine's processors can do, read once and without side effects."""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings

import torch

from speedups._helpers import env
from speedups.errors import SpeedupsWarning

__all__ = [
    "bf16_in_cpuinfo",
    "cpu_fp32_matmul_rate",
    "cpu_has_native_bf16",
    "cpus_per_process",
    "gpu_has_native_bf16",
    "matmul_rate",
    "usable_cpus",
]


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Return True when this CPU computes bf16 natively (x86 AVX-512 BF16 or AMX, Arm BF16).

    Without it, bf16 matrix work on the CPU is emulated and far slower than fp32 (about 30x seen on an
    AVX2 machine). Read from ``/proc/cpuinfo`` flags on Linux, ``sysctl hw.optional.arm.FEAT_BF16`` on macOS;
    False elsewhere.
    """
    system = platform.system()
    if system == "Linux":
        try:
            with open("/proc/cpuinfo") as f:
                return bf16_in_cpuinfo(f.read())
        except OSError:
            return False
    if system == "Darwin":
        import subprocess

        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=5
            )
        except (OSError, subprocess.SubprocessError):
            return False
        return out.stdout.strip() == "1"
    return False


def matmul_rate(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024
) -> float:
    """FLOP/s of an ``n x n`` ``torch.matmul`` in ``dtype`` on ``device`` at torch's current thread count.

    The best of 3 timings after one warm-up (the device synchronized around each on CUDA): the rate a
    well-shaped product reaches. The operands are constant, so no random number is drawn and the run's RNG
    streams stay as they were. Used by the profiler's ``cpu-fp32-matmul`` advice and the language-model
    benchmark's MFU.
    """
    device = torch.device(device)
    a = b = torch.full((n, n), 0.5, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    best = float("inf")
    for _ in range(3):
        sync()
        start = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9)


@functools.lru_cache(maxsize=1)
def cpu_fp32_matmul_rate() -> float:
    """This CPU's fp32 rate (:func:`matmul_rate` at 1024, about 10 ms on 2 cores), measured once: what the
    profiler prices a step's fp32 matrix work against."""
    return matmul_rate("cpu", torch.float32, 1024)


def gpu_has_native_bf16(index: int | None = None) -> bool:
    """Return True when CUDA device ``index`` (the current device when None) computes bf16 natively.

    NVIDIA: compute capability 8.0 or higher (Ampere on). Below it (T4, V100, RTX 20xx) bf16 is emulated:
    slow, and cuDNN has no bf16 convolutions, though ``torch.cuda.is_bf16_supported()`` answers True there by
    default (``including_emulation=True``). ROCm: whatever torch says (MI200 on compute bf16).
    """
    if getattr(torch.version, "hip", None):
        return bool(torch.cuda.is_bf16_supported())
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).major >= 8


def bf16_in_cpuinfo(cpuinfo: str) -> bool:
    """Whether the ``flags`` (x86) or ``Features`` (Arm) lines of a ``/proc/cpuinfo`` text show bf16."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def usable_cpus() -> int:
    """Return how many CPUs this process may run on (its affinity mask where the OS has one)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        return len(getaffinity(0))
    return os.cpu_count() or 1


def cpus_per_process() -> int:
    """Return the CPUs this process may use, shared among the job's processes on this node.

    ``usable_cpus() // LOCAL_WORLD_SIZE``: what ``fast_loader(num_workers="auto")`` gives each process,
    and the top of ``tune_loader``'s grid. 0 when the node runs more processes than it has CPUs. A local
    world size larger than the whole job's (a ``LOCAL_WORLD_SIZE`` left over in the shell, outside any
    job) is ignored, with one ``SpeedupsWarning`` that names it.
    """
    local, world = env.local_world_size(), env.world_size()
    if not 1 <= local <= world:
        _warn_stale_local_world_size(local, world)
        local = world
    return usable_cpus() // max(1, local)


@functools.cache
def _warn_stale_local_world_size(local: int, world: int) -> None:
    warnings.warn(
        f"speedups: LOCAL_WORLD_SIZE={local} but the job has {world} process(es) (WORLD_SIZE unset, or "
        f"a node count that cannot be): a variable left over in the shell? It is ignored, and CPUs are "
        f"shared among {world} process(es). Unset it (`unset LOCAL_WORLD_SIZE`) outside a launcher.",
        SpeedupsWarning,
        stacklevel=4,
    )

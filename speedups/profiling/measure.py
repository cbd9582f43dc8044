"""What the profiler measures besides wall time: the batch size, peak memory, and on a *sampled* step the
host-device syncs, CPU bf16 matrix work, CUDA cache frees and the GPU's activity.

:meth:`Sampling.begin` enters the counters when a sampled step starts; :meth:`Sampling.end` leaves them, in
the reverse order, and returns what they counted. Unsampled steps enter nothing and pay nothing.
"""

from __future__ import annotations

import statistics
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from speedups._helpers.tree import tree_map
from speedups.profiling.gpu_activity import GpuActivity
from speedups.profiling.kernel_timer import KernelTimer

__all__ = [
    "Counts",
    "LoaderBatchSizes",
    "SampleMode",
    "Sampling",
    "gpus_in_use",
    "p90",
    "peak_memory",
    "samples_in",
]

# Tensor calls that read a value into Python: each is a host-device sync when the tensor is on an accelerator
# (a read of a CPU tensor, such as Adam's step counter or a PackedSequence's batch_sizes, is not).
_SYNC_CALLS = frozenset(
    {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "__format__", "__repr__", "__str__"}
)
# Calls that copy to the host (a sync when the source is on an accelerator).
_TO_HOST_CALLS = frozenset({"cpu", "to", "numpy"})
# Calls whose bf16 form on a CPU without native bf16 is the slow path the advice warns about.
_MATMUL_CALLS = frozenset(
    {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d",
     "conv3d", "conv_transpose2d", "scaled_dot_product_attention"}
)  # fmt: skip


class SampleMode(TorchFunctionMode):
    """Active during a sampled step: counts host syncs, bf16 matrix work on the CPU and the FLOPs of fp32
    matrix work on the CPU (:func:`matmul_flops`), and in debug mode keeps weak references to the scalar
    tensors with an autograd graph (the losses) made in the step.

    A ``TorchFunctionMode`` (public API, above autograd) sees every Python-level tensor call, and the calls
    that read a device value into Python are exactly the syncs a loop writes by hand: ``.item()``,
    ``float(t)``, ``int(t)``, ``if t:``, ``.tolist()``, ``print(t)``, ``.numpy()``, and copies to the CPU.
    Only reads of tensors on an accelerator count: reading a CPU tensor waits for nothing.
    """

    def __init__(self, loss_refs: list[weakref.ref[torch.Tensor]] | None) -> None:
        super().__init__()
        self.syncs = 0
        self.cpu_bf16_matmuls = 0
        self.cpu_fp32_matmul_flops = 0.0
        self.loss_refs = loss_refs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in _SYNC_CALLS:
            if args and reads_the_device(args[0]):
                self.syncs += 1
        elif name in _TO_HOST_CALLS:
            src = args[0] if args else None
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and _on_cpu(out):
                self.syncs += 1
        elif name in _MATMUL_CALLS and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            if out.dtype == torch.bfloat16:
                self.cpu_bf16_matmuls += 1
            elif out.dtype == torch.float32:
                self.cpu_fp32_matmul_flops += matmul_flops(name, args, out)
        if (
            self.loss_refs is not None
            and isinstance(out, torch.Tensor)
            and out.dim() == 0
            and out.grad_fn is not None
        ):
            self.loss_refs.append(weakref.ref(out))
        return out


def matmul_flops(name: str, args: Any, out: torch.Tensor) -> float:
    """FLOPs of one matrix call from its shapes: ``2 x outputs x inner size`` (``linear``, ``matmul``,
    ``mm``, ``bmm``, ``addmm``, ``baddbmm``), ``4 x queries x keys x head width`` for
    ``scaled_dot_product_attention``; times 3 when the output requires grad (the backward's two products).
    0 for the calls not counted here (``einsum``, convolutions) and for arguments that are not tensors.
    """
    try:
        if name == "scaled_dot_product_attention":
            q, k = args[0], args[1]
            flops = 4.0 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
        elif name in ("linear", "matmul", "__matmul__", "mm", "bmm"):
            inner = args[1].shape[-1] if name == "linear" else args[0].shape[-1]
            flops = 2.0 * out.numel() * inner
        elif name in ("addmm", "baddbmm"):
            flops = 2.0 * out.numel() * args[1].shape[-1]
        else:
            return 0.0
    except (AttributeError, IndexError, TypeError):
        return 0.0
    return flops * (3 if out.requires_grad else 1)


def reads_the_device(tensor: Any) -> bool:
    """Whether reading ``tensor`` into Python waits for an accelerator (a tensor not on the CPU or meta)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta")


def _on_cpu(out: Any) -> bool:
    """True for a CPU tensor or a non-tensor (a numpy array, a list): the value reached the host."""
    return not isinstance(out, torch.Tensor) or out.device.type == "cpu"


# What CUDA's sync debug mode warns on each sync (c10/cuda/CUDAFunctions.cpp). Its one-off notice that the
# mode "does not yet detect all synchronizing operations" is not a sync and must not count as one.
_SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclass(slots=True)
class _CudaSyncCount:
    """On a sampled GPU step: CUDA's sync debug mode warns on every sync inside torch, caught here, and the
    GPU's activity is traced (busy time, kernels, what they ran).

    ``previous_mode`` is the sync debug mode to restore; ``frees_before`` the driver frees so far;
    ``kernels`` the GPU activity tracer (None where it cannot run).
    """

    catcher: warnings.catch_warnings
    caught: list[warnings.WarningMessage] | None
    previous_mode: int
    frees_before: int
    kernels: KernelTimer | None


@dataclass(slots=True)
class Counts:
    """What one sampled step counted (see ``StepRecord`` for each field)."""

    syncs: int
    cpu_bf16_matmuls: int
    cpu_fp32_matmul_flops: float
    cache_frees: int | None
    loss_refs: list[weakref.ref[torch.Tensor]] | None
    gpu: GpuActivity | None


@dataclass(slots=True)
class Sampling:
    """The counters a sampled step entered."""

    counter: SampleMode
    cuda: _CudaSyncCount | None

    @classmethod
    def begin(cls, *, on_gpu: bool, keep_losses: bool) -> Sampling:
        """Enter the counters (CUDA's sync count first, when ``on_gpu``); ``keep_losses``: for ``check``."""
        cuda = None
        if on_gpu:
            frees_before = _device_frees()
            kernels = KernelTimer.start()
            previous_mode = torch.cuda.get_sync_debug_mode()
            catcher = warnings.catch_warnings(record=True)
            caught = catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            cuda = _CudaSyncCount(catcher, caught, previous_mode, frees_before, kernels)
        counter = SampleMode([] if keep_losses else None)
        counter.__enter__()
        return cls(counter, cuda)

    def end(self) -> Counts:
        """Leave the counters in the reverse order of entry; return what they counted."""
        counter, cuda = self.counter, self.cuda
        counter.__exit__(None, None, None)
        syncs, cache_frees, gpu = counter.syncs, None, None
        if cuda is not None:
            torch.cuda.set_sync_debug_mode(cuda.previous_mode)
            cuda.catcher.__exit__(None, None, None)
            # the sync debug mode also sees syncs inside torch (nonzero, masked indexing, ...)
            syncs = max(syncs, sum(_SYNC_WARNING in str(w.message) for w in cuda.caught or ()))
            cache_frees = _device_frees() - cuda.frees_before
            gpu = cuda.kernels.stop() if cuda.kernels is not None else None
        return Counts(
            syncs,
            counter.cpu_bf16_matmuls,
            counter.cpu_fp32_matmul_flops,
            cache_frees,
            counter.loss_refs,
            gpu,
        )


def gpus_in_use() -> list[int]:
    """The CUDA devices holding memory of this process (a model on ``cuda:1``, ``shard_model``'s parts),
    else the current one: what a step's events and memory statistics must cover, not the current device."""
    used = [i for i in range(torch.cuda.device_count()) if torch.cuda.memory_allocated(i) > 0]
    return used or [torch.cuda.current_device()]


def _device_frees() -> int:
    """CUDA memory blocks returned to the driver so far in this process, on every GPU."""
    return sum(
        int(torch.cuda.memory_stats(i).get("num_device_free", 0)) for i in range(torch.cuda.device_count())
    )


def samples_in(batch: Any) -> int | None:
    """The leading dimension of the first tensor (of dimension >= 1) in ``batch``, or None."""
    if isinstance(batch, torch.Tensor):  # the common cases without walking a tree
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0]) if batch[0].dim() else None
    sizes: list[int] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            sizes.append(int(leaf.shape[0]))
        return leaf

    tree_map(visit, batch)
    return sizes[0] if sizes else None


class LoaderBatchSizes:
    """The samples in each batch of one pass over a ``DataLoader``, from its ``batch_size``, not a shape.

    Every batch holds ``batch_size`` samples except a short last one (a sized dataset without ``drop_last``),
    whatever the layout of the tensors (a sequence-first batch has time, not samples, on dimension 0).
    ``None`` from :meth:`make` when the loader does not batch automatically (a ``batch_sampler`` or
    ``batch_size=None``): then the caller falls back to :func:`samples_in`.
    """

    __slots__ = ("batches", "full", "index", "last")

    def __init__(self, full: int, last: int, batches: int | None) -> None:
        self.full, self.last, self.batches, self.index = full, last, batches, 0

    @classmethod
    def make(cls, loader: Any) -> LoaderBatchSizes | None:
        full = getattr(loader, "batch_size", None)
        if not isinstance(loader, torch.utils.data.DataLoader) or not isinstance(full, int):
            return None
        try:
            n_items, batches = len(loader.dataset), len(loader)  # type: ignore[arg-type]
        except TypeError:  # an iterable dataset without a length
            return cls(full, full, None)
        short = 0 if loader.drop_last else n_items % full
        return cls(full, short or full, batches)

    def next(self) -> int:
        """The samples in the next batch of the pass."""
        self.index += 1
        return self.last if self.batches is not None and self.index == self.batches else self.full


def p90(values: list[float]) -> float:
    """The 90th percentile of ``values`` (linear between the closest ranks, as numpy's default)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def peak_memory() -> str:
    """Peak CUDA memory allocated (once CUDA is in use) and peak process RSS, in MiB, as text."""
    parts = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):  # every GPU, not the current one only
            peak = torch.cuda.max_memory_allocated(i)
            if peak:
                parts.append(f"{peak / 2**20:.0f} MiB allocated on cuda:{i}")
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = rss if sys.platform == "darwin" else rss * 1024
        parts.append(f"{rss_bytes / 2**20:.0f} MiB process RSS (peak)")
    except ImportError:  # Windows
        pass
    return "; ".join(parts) or "not measurable here"

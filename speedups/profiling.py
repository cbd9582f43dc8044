"""Tip 10: see where each training step's time goes, and which tip would help.

``profile_steps()`` times every step of a plain loop (time waiting for the batch vs time in the step),
counts host-device syncs on a few sampled steps, and turns what it saw into advice that names the fix::

    with profile_steps() as prof:
        for batch in prof.iter(loader):
            train_step(*batch)
    print(prof.report())
    prof.plot("steps.png")

With ``debug=True`` (or :func:`check`) it also watches for classic mistakes while the loop runs: a loss
tensor kept alive with its autograd graph, a ``DistributedSampler`` replaying the same epoch, an
``optimizer.step()`` on a micro-step that ``@accumulate`` does not step on, and a ``no_sync`` that covers
backward but not forward. Each warns once, with the fix as code.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import wrapt
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from speedups import _step
from speedups._hardware import cpu_has_native_bf16, usable_cpus
from speedups._tree import tree_map
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["Advice", "Report", "StepProfiler", "StepRecord", "check", "profile_steps"]

F = TypeVar("F", bound=Callable[..., Any])

_NO_MODES: list[Any] = []  # shared by unsampled steps; never appended to

# Tensor calls that read a value into Python: each is a host-device sync on an accelerator.
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


@dataclass(slots=True)
class StepRecord:
    """One profiled step.

    Attributes:
        data_s: seconds spent waiting for this step's batch (``prof.iter``), or, for a step recorded only by
            the decorator, the seconds between the end of the previous step and the start of this one.
        step_s: seconds of host wall time in the step itself.
        samples: batch size (leading dimension of the first tensor of the batch), None if unknown.
        sampled: whether syncs were counted on this step (then slower, so left out of the means).
        cache_frees: CUDA memory blocks returned to the driver during a sampled step.
        cpu_bf16_matmuls: bf16 matrix ops seen on the CPU during a sampled step.
        syncs: host-device syncs counted on a sampled step (``.item()``, ``float(t)``, ``.tolist()``, ...).
        device_s: GPU time of the step from CUDA events, filled in when the report is made.
    """

    data_s: float
    step_s: float
    samples: int | None = None
    sampled: bool = False
    syncs: int | None = None
    device_s: float | None = None
    cache_frees: int | None = None
    cpu_bf16_matmuls: int = 0
    claimed_s: float | None = field(default=None, repr=False)  # time in decorated calls within the step
    _events: tuple[Any, Any] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Advice:
    """One tip that would help, with its estimated value (the fraction of step time it could save)."""

    rule: str
    message: str
    fix: str
    value: float

    def __str__(self) -> str:
        return f"{self.message}\n     fix: {self.fix}"


@dataclass(frozen=True)
class Summary:
    """What the advice rules read: aggregates over the timed steps (seconds, fractions, counts)."""

    steps: int
    mean_data_s: float
    mean_step_s: float
    data_fraction: float
    syncs_per_step: float | None
    sampled_steps: int
    samples_per_s: float | None
    mean_batch: float | None
    device_type: str
    device_busy_fraction: float | None
    cache_frees_per_step: float | None
    cpu_bf16_matmuls: int
    native_cpu_bf16: bool
    loader_workers: int | None
    usable_cpus: int
    peak_memory: str


# ------------------------------------------------------------------------------------------ advice rules
def _rule_data_bound(s: Summary) -> Advice | None:
    if s.data_fraction < 0.2:
        return None
    return Advice(
        "data-bound",
        f"{s.data_fraction:.0%} of each step waits for data.",
        "loader = fast_loader(dataset, batch_size=...); loader, report = tune_loader(loader)",
        s.data_fraction,
    )


def _rule_workers_zero(s: Summary) -> Advice | None:
    if s.loader_workers != 0 or s.usable_cpus < 2 or s.data_fraction < 0.05:
        return None
    return Advice(
        "num-workers-0",
        f"The DataLoader loads in the training process (num_workers=0) while {s.usable_cpus} CPUs are "
        f"usable; {s.data_fraction:.0%} of each step waits for it.",
        "loader = fast_loader(dataset, batch_size=..., num_workers='auto')  # or tune_loader(loader)",
        0.9 * s.data_fraction,
    )


def _rule_sync_bound(s: Summary) -> Advice | None:
    if s.syncs_per_step is None or s.syncs_per_step < 1:
        return None
    return Advice(
        "sync-bound",
        f"A host-device sync every step ({s.syncs_per_step:.1f} per step, from .item(), float(t), print(t), "
        f".tolist() or a Python `if` on a tensor): each one waits for the device to finish.",
        "tracker = LossTracker(); tracker.update(loss, n=len(y))  # read it every N steps: f'{tracker:.4f}'",
        0.3 if s.device_type == "cuda" else 0.1,
    )


def _rule_empty_cache(s: Summary) -> Advice | None:
    if s.cache_frees_per_step is None or s.cache_frees_per_step < 1:
        return None
    return Advice(
        "empty-cache",
        f"GPU memory goes back to the driver inside the loop ({s.cache_frees_per_step:.0f} frees per step): "
        f"torch.cuda.empty_cache() in the loop makes every step allocate from scratch.",
        "remove torch.cuda.empty_cache() from the training loop (call it once, if at all, after training)",
        0.25,
    )


def _rule_tiny_batches(s: Summary) -> Advice | None:
    if s.device_type != "cuda" or s.device_busy_fraction is None or s.data_fraction >= 0.2:
        return None
    if s.device_busy_fraction >= 0.5:
        return None
    return Advice(
        "tiny-batches",
        f"The GPU is busy only {s.device_busy_fraction:.0%} of each step"
        + (f" with batches of {s.mean_batch:.0f}" if s.mean_batch else "")
        + ": Python and kernel launches dominate.",
        "bs = find_batch_size(probe_step, model, optimizer)  # larger batches; @accumulate keeps the math",
        1.0 - s.device_busy_fraction,
    )


def _rule_cpu_bf16(s: Summary) -> Advice | None:
    if s.cpu_bf16_matmuls == 0 or s.native_cpu_bf16:
        return None
    return Advice(
        "cpu-bf16",
        "bf16 matrix work runs on a CPU without native bf16 (no AVX-512 BF16 or AMX): it is emulated, "
        "often ~30x slower than fp32.",
        "with mixed_precision('auto'):  # stays in fp32 on this CPU, bf16 where it is native",
        0.9,
    )


RULES: tuple[Callable[[Summary], Advice | None], ...] = (
    _rule_data_bound,
    _rule_workers_zero,
    _rule_sync_bound,
    _rule_empty_cache,
    _rule_tiny_batches,
    _rule_cpu_bf16,
)


def advise(summary: Summary) -> list[Advice]:
    """Apply every rule to ``summary``; return the tips that fire, most valuable first."""
    found = [a for rule in RULES if (a := rule(summary)) is not None]
    return sorted(found, key=lambda a: a.value, reverse=True)


# --------------------------------------------------------------------------------------- sampling mode
class _SampleMode(TorchFunctionMode):
    """Active during a sampled step: counts host syncs and bf16 matrix work on the CPU, and in debug mode
    keeps weak references to the scalar tensors with an autograd graph (the losses) made in the step.

    A ``TorchFunctionMode`` (public API, above autograd) sees every Python-level tensor call, and the calls
    that read a device value into Python are exactly the syncs a loop writes by hand: ``.item()``,
    ``float(t)``, ``int(t)``, ``if t:``, ``.tolist()``, ``print(t)``, ``.numpy()``, and copies to the CPU.
    """

    def __init__(self, loss_refs: list[weakref.ref[torch.Tensor]] | None) -> None:
        super().__init__()
        self.syncs = 0
        self.cpu_bf16_matmuls = 0
        self.loss_refs = loss_refs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in _SYNC_CALLS:
            self.syncs += 1
        elif name in _TO_HOST_CALLS:
            src = args[0] if args else None
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and _on_cpu(out):
                self.syncs += 1
        elif (
            name in _MATMUL_CALLS
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.bfloat16
            and out.device.type == "cpu"
        ):
            self.cpu_bf16_matmuls += 1
        if (
            self.loss_refs is not None
            and isinstance(out, torch.Tensor)
            and out.dim() == 0
            and out.grad_fn is not None
        ):
            self.loss_refs.append(weakref.ref(out))
        return out


def _on_cpu(out: Any) -> bool:
    """True for a CPU tensor or a non-tensor (a numpy array, a list): the value reached the host."""
    return not isinstance(out, torch.Tensor) or out.device.type == "cpu"


class _ProfiledFunction(wrapt.FunctionWrapper):
    """A step function recorded by a :class:`StepProfiler`; ``.profiler`` is that profiler."""

    _self_profiler: StepProfiler

    @property
    def profiler(self) -> StepProfiler:
        return self._self_profiler


# -------------------------------------------------------------------------------------------- profiler
class StepProfiler:
    """Time each training step, count its syncs, and say which tip would help. Made by :func:`profile_steps`.

    Use ``prof.iter(loader)`` to time the wait for each batch and the step that follows it, or decorate the
    step function (``@prof``) to time each call; both together give the decorator's time as the step and
    the loader's time as the data wait. ``with prof:`` brackets the run (and removes the debug hooks).

    Cost: two ``time.perf_counter()`` calls and a list append per step (plus two CUDA events on a GPU, no
    sync): about 5 microseconds a step in a real loop. A few steps are *sampled*: the first after warm-up,
    then as rarely as keeps their extra cost under 1% of the run (or every ``sample_every``-th step when
    given). On a sampled step a ``TorchFunctionMode`` counts the calls that read a tensor into Python
    (``.item()``, ``float(t)``, ``if t:``, ``.tolist()``, ``print(t)``, copies to the CPU), and on a GPU
    CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode``) also counts the syncs inside torch. A sampled
    step runs slower, so its time is left out of the means. ``benchmarks/profiling.py`` measures the whole
    cost against the plain loop.
    """

    def __init__(
        self,
        *,
        warmup: int = 1,
        sample_every: int | None = None,
        debug: bool = False,
        model: torch.nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(
                f"profile_steps(warmup={warmup!r}): warmup is the number of first steps left out of the "
                f"means and must be an int >= 0, e.g. warmup=1."
            )
        if sample_every is not None and (
            isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1
        ):
            raise ValueError(
                f"profile_steps(sample_every={sample_every!r}): must be None (sample as rarely as keeps the "
                f"overhead under 1%) or an int >= 1 (count syncs on every n-th step), e.g. sample_every=50."
            )
        for flag, value in (("debug", debug), ("enabled", enabled)):
            if not isinstance(value, bool):
                raise TypeError(f"profile_steps({flag}={value!r}): expected True or False.")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"profile_steps(model={model!r}): expected an nn.Module (the DDP-wrapped model).")
        self.enabled = enabled
        self.warmup = warmup
        self.sample_every = 1 if debug else sample_every
        self._next_sample_at = 0.0  # adaptive sampling: perf_counter time before which no step is sampled
        self._last_plain_s: float | None = None  # the latest unsampled step's time
        self.debug = debug
        self.model = model
        self.steps: list[StepRecord] = []
        """Every recorded step, warm-up steps included."""
        self._start: float | None = None
        self._last_end: float | None = None
        self._open: StepRecord | None = None  # the step `iter` has handed out and not yet closed
        self._loader_workers: int | None = None
        self._warned: set[str] = set()
        self._loss_refs: list[list[weakref.ref[torch.Tensor]]] = []
        self._sampler_epochs: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._checker_token: Any = None
        self._accumulated: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        self._finished = False

    # ------------------------------------------------------------------------ context manager / decorator
    def __enter__(self) -> StepProfiler:
        if self._checker_token is not None or self._hooks:
            raise SpeedupsError(
                "profile_steps(): this profiler is already entered. Use one `with` block per profiler, or "
                "make a new one: `with profile_steps() as prof:`."
            )
        if self.enabled:
            self._start = time.perf_counter()
            self._last_end = self._start
            if self.debug:
                self._checker_token = _step.active_checker.set(self)
                self._hooks.append(register_optimizer_step_pre_hook(self._on_optimizer_step))
                if self.model is not None:
                    self._install_no_sync_detector(self.model)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._checker_token is not None:
            _step.active_checker.reset(self._checker_token)
            self._checker_token = None

    def __call__(self, fn: F) -> F:
        """Decorate a step function: each call is one step (``enabled=False``: ``fn`` is returned as is)."""
        if not callable(fn):
            raise TypeError(f"profile_steps()({fn!r}): expected a step function to decorate.")
        if isinstance(fn, type):
            raise TypeError(
                f"profile_steps()({fn.__name__}): decorate the step function or method, not a class."
            )
        if not self.enabled:
            return fn

        def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            start = time.perf_counter()
            open_record = self._open
            if open_record is not None:  # inside a `prof.iter` step: time the call as that step's work
                if open_record.claimed_s is None:
                    open_record.claimed_s = 0.0
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    open_record.claimed_s += time.perf_counter() - start
            last = self._last_end if self._last_end is not None else start
            record, modes = self._begin(start - last, _batch_size((args, kwargs)), start)
            try:
                return wrapped(*args, **kwargs)
            finally:
                self._end(record, start, modes)

        profiled = _ProfiledFunction(fn, wrapper)
        profiled._self_profiler = self
        return profiled  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ iterate
    def iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield the batches of ``iterable``, timing the wait for each and the step that follows it.

        Raises:
            TypeError: ``iterable`` is not iterable.
        """
        try:
            iterator = iter(iterable)
        except TypeError:
            raise TypeError(
                f"profile_steps().iter({iterable!r}): expected an iterable of batches such as a DataLoader, "
                f"got {type(iterable).__name__}. Use `for batch in prof.iter(loader):`."
            ) from None
        if not self.enabled:
            return iterator
        return self._iterate(iterable, iterator)

    def _iterate(self, iterable: Iterable[Any], iterator: Iterator[Any]) -> Iterator[Any]:
        if isinstance(iterable, torch.utils.data.DataLoader):
            self._loader_workers = iterable.num_workers
        if self._start is None:
            self._start = time.perf_counter()
        first = True
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            t1 = time.perf_counter()
            if first:
                first = False
                if self.debug:
                    self._check_sampler_epoch(iterable)
            record, modes = self._begin(t1 - t0, _batch_size(batch), t1)
            self._open = record
            try:
                yield batch
            finally:
                self._open = None
                self._end(record, t1, modes)

    # ------------------------------------------------------------------------------------ step bookkeeping
    def _begin(self, data_s: float, samples: int | None, now: float) -> tuple[StepRecord, list[Any]]:
        index = len(self.steps)
        if index < self.warmup:
            sampled = False
        elif self.sample_every is not None:
            sampled = (index - self.warmup) % self.sample_every == 0
        else:
            sampled = now >= self._next_sample_at
        record = StepRecord(data_s, 0.0, samples, sampled)
        self.steps.append(record)
        modes: list[Any] = _NO_MODES
        if torch.cuda.is_initialized():  # cheap flag check; True only once CUDA is in use
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
            record._events = (start_ev, end_ev)
        if sampled:
            modes = []
            if record._events is not None:
                record.cache_frees = -_device_frees()
                debug_mode = torch.cuda.get_sync_debug_mode()
                catcher = warnings.catch_warnings(record=True)
                caught = catcher.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                modes.append(("cuda-sync", catcher, caught, debug_mode))
            refs: list[weakref.ref[torch.Tensor]] | None = [] if self.debug else None
            sample_mode = _SampleMode(refs)
            sample_mode.__enter__()
            modes.append(("sample", sample_mode))
        return record, modes

    def _end(self, record: StepRecord, start: float, modes: list[Any]) -> None:
        end = time.perf_counter()
        record.step_s = end - start if record.claimed_s is None else record.claimed_s
        self._last_end = end
        if not record.sampled:
            self._last_plain_s = record.step_s
        elif self.sample_every is None:
            # The next sample waits until this one's extra cost is 1% of the time in between (and at least
            # 10 steps' worth), so sampling never costs more than about 1% of the run.
            extra = max(record.step_s - (self._last_plain_s or 0.0), 0.0)
            self._next_sample_at = end + max(100 * extra, 10 * (self._last_plain_s or record.step_s))
        if record._events is not None:
            record._events[1].record()
        for mode in reversed(modes):  # exit in the reverse order of entry
            kind = mode[0]
            if kind == "sample":
                mode[1].__exit__(None, None, None)
                record.syncs = mode[1].syncs
                record.cpu_bf16_matmuls = mode[1].cpu_bf16_matmuls
                if mode[1].loss_refs is not None:
                    self._loss_refs.append(mode[1].loss_refs)
            elif kind == "cuda-sync":
                torch.cuda.set_sync_debug_mode(mode[3])
                mode[1].__exit__(None, None, None)
                # the sync debug mode also sees syncs inside torch (nonzero, masked indexing, ...)
                record.syncs = max(record.syncs or 0, sum("synchronizing" in str(w.message) for w in mode[2]))
                record.cache_frees = (record.cache_frees or 0) + _device_frees()
        if self.debug:
            self._check_kept_graphs()

    # -------------------------------------------------------------------------------------------- debug
    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, SpeedupsWarning, stacklevel=4)

    def watch_accumulated(self, optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Called by ``@accumulate`` inside ``check()``: ``step`` is what steps ``optimizer``."""
        self._accumulated[optimizer] = step

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = self._accumulated.get(optimizer)
        if step is None or _step.owned_update.get():
            return
        self._warn_once(
            "accumulate-step",
            f"speedups.check: optimizer.step() was called by hand on an optimizer that @accumulate steps "
            f"(after micro-step {step.step}, {step.pending} of {step.every} of the window accumulated), "
            f"so it steps on micro-steps that should only accumulate. Fix: remove the `optimizer.step()` "
            f"(and `optimizer.zero_grad()`) from the loop; @accumulate steps on every {step.every}-th "
            f"call and `train_step.flush()` applies a short last window.",
        )

    def _check_kept_graphs(self) -> None:
        # At the end of step k, the scalars with graphs made during step k-1 should be gone: the loop's
        # `loss` variable now names step k's loss. One still alive was stored somewhere.
        while len(self._loss_refs) > 1:
            old = self._loss_refs.pop(0)
            if any((t := r()) is not None and t.grad_fn is not None for r in old):
                self._warn_once(
                    "kept-graph",
                    "speedups.check: a loss tensor from an earlier step is still alive with its "
                    "autograd graph (e.g. `losses.append(loss)`), which keeps that step's activations in "
                    "memory. Fix: `losses.append(loss.detach())`, or `tracker = LossTracker(); "
                    "tracker.update(loss)`.",
                )

    def _check_sampler_epoch(self, iterable: Iterable[Any]) -> None:
        sampler = getattr(iterable, "sampler", None)
        batch_sampler = getattr(iterable, "batch_sampler", None)
        if not isinstance(sampler, torch.utils.data.DistributedSampler):
            sampler = getattr(batch_sampler, "sampler", None)
        if not isinstance(sampler, torch.utils.data.DistributedSampler):
            return
        epoch = int(sampler.epoch)
        if self._sampler_epochs.get(id(sampler)) == epoch:
            self._warn_once(
                "sampler-epoch",
                f"speedups.check: the DistributedSampler was iterated again with the same epoch "
                f"({epoch}), so every epoch replays the same order. Fix: call "
                f"`loader.sampler.set_epoch(epoch)` before each epoch, or `loader = distributed(loader)`, "
                f"which does it for you.",
            )
        self._sampler_epochs[id(sampler)] = epoch

    def _install_no_sync_detector(self, model: torch.nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return

        def after_forward(module: Any, args: Any, output: Any) -> None:
            synced_forward = bool(module.require_backward_grad_sync) and torch.is_grad_enabled()
            leaf = next(
                (t for t in _tensors(output) if t.requires_grad),
                None,
            )
            if leaf is None or not synced_forward:
                return

            def at_backward(grad: torch.Tensor) -> None:
                if not module.require_backward_grad_sync:
                    self._warn_once(
                        "no-sync-forward",
                        "speedups.check: backward ran inside `model.no_sync()` but forward did "
                        "not, so DDP still all-reduces this micro-step. Fix: put the forward inside too: "
                        "`with model.no_sync(): loss = loss_fn(model(x), y); loss.backward()`, or use "
                        "@accumulate, which does it for you.",
                    )

            leaf.register_hook(at_backward)

        self._hooks.append(model.register_forward_hook(after_forward))

    # ------------------------------------------------------------------------------------------ results
    def summary(self) -> Summary:
        """Aggregate the recorded steps (one sync on a GPU, to read the CUDA events).

        Raises:
            SpeedupsError: no step was recorded yet (or profiling is disabled).
        """
        if not self.enabled:
            raise SpeedupsError(
                "profile_steps(enabled=False).report(): profiling is disabled, so nothing was recorded. "
                "Use profile_steps() (enabled=True) to get a report."
            )
        if not self.steps:
            raise SpeedupsError(
                "profile_steps().report(): no step was recorded yet. Iterate with "
                "`for batch in prof.iter(loader):` or decorate the step function with `@prof`, run a few "
                "steps, then call prof.report()."
            )
        timed = self.steps[self.warmup :] or self.steps
        unsampled = [r for r in timed if not r.sampled]
        if len(unsampled) >= max(1, len(timed) // 2):
            timed = unsampled
        for r in self.steps:
            if r._events is not None and r.device_s is None:
                r._events[1].synchronize()
                r.device_s = r._events[0].elapsed_time(r._events[1]) / 1000.0
        mean_data = statistics.fmean(r.data_s for r in timed)
        mean_step = statistics.fmean(r.step_s for r in timed)
        total = mean_data + mean_step
        sampled = [r for r in self.steps if r.syncs is not None]
        sizes = [r.samples for r in timed if r.samples is not None]
        device_times = [r.device_s for r in timed if r.device_s is not None]
        frees = [r.cache_frees for r in self.steps if r.cache_frees is not None]
        return Summary(
            steps=len(self.steps),
            mean_data_s=mean_data,
            mean_step_s=mean_step,
            data_fraction=mean_data / total if total > 0 else 0.0,
            syncs_per_step=statistics.fmean(r.syncs or 0 for r in sampled) if sampled else None,
            sampled_steps=len(sampled),
            samples_per_s=(statistics.fmean(sizes) / total) if sizes and total > 0 else None,
            mean_batch=statistics.fmean(sizes) if sizes else None,
            device_type="cuda" if device_times else "cpu",
            device_busy_fraction=(statistics.fmean(device_times) / total) if device_times and total else None,
            cache_frees_per_step=statistics.fmean(frees) if frees else None,
            cpu_bf16_matmuls=sum(r.cpu_bf16_matmuls for r in self.steps),
            native_cpu_bf16=cpu_has_native_bf16(),
            loader_workers=self._loader_workers,
            usable_cpus=usable_cpus(),
            peak_memory=_peak_memory(),
        )

    def advice(self) -> list[Advice]:
        """The tips that would help this loop, most valuable first (see :meth:`report`)."""
        return advise(self.summary())

    def report(self) -> Report:
        """Summarise the run: a table of per-step times and the tips that would help, most valuable first.

        Sync point: one device sync on a GPU (CUDA events are read).

        Raises:
            SpeedupsError: no step was recorded yet.
        """
        summary = self.summary()
        return Report(summary, advise(summary))

    def plot(self, path: str | Path) -> Path:
        """Draw data wait and step time per step as stacked bars into a PNG at ``path``; return the path.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'speedups[examples]'``).
            SpeedupsError: no step was recorded yet.
        """
        summary = self.summary()
        try:
            import matplotlib
        except ImportError:
            raise ImportError(
                "profile_steps().plot() needs matplotlib, which is not installed. "
                "Install it with `pip install 'speedups[examples]'` (or `pip install matplotlib`)."
            ) from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        steps = range(len(self.steps))
        data_ms = [r.data_s * 1e3 for r in self.steps]
        step_ms = [r.step_s * 1e3 for r in self.steps]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar(steps, data_ms, color="#dd8452", label="waiting for data")
        ax.bar(steps, step_ms, bottom=data_ms, color="#4c72b0", label="in the step")
        sampled = [i for i, r in enumerate(self.steps) if r.sampled]
        plain_tops = [d + t for d, t, r in zip(data_ms, step_ms, self.steps, strict=True) if not r.sampled]
        top = 1.5 * max(plain_tops) if plain_tops else None
        if top:  # sampled steps can be far slower (the first one warms up the counter): keep them in view
            ax.set_ylim(0, top)
        if sampled:
            tops = [min(data_ms[i] + step_ms[i], top or math.inf) for i in sampled]
            ax.scatter(sampled, tops, marker="v", color="black", s=12, label="syncs counted (slower, cut)")
        ax.set_xlabel("step")
        ax.set_ylabel("milliseconds")
        ax.set_title(
            f"where the time goes: {summary.data_fraction:.0%} waiting for data, "
            f"{1 - summary.data_fraction:.0%} in the step"
        )
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


@dataclass(frozen=True)
class Report:
    """What :meth:`StepProfiler.report` returns; ``str(report)`` is the table followed by the advice."""

    summary: Summary
    advice: list[Advice]

    def __str__(self) -> str:
        s = self.summary
        ms = 1e3
        lines = [
            f"speedups.profile_steps: {s.steps} steps",
            f"  waiting for data   {s.mean_data_s * ms:9.3f} ms/step  ({s.data_fraction:.0%})",
            f"  in the step        {s.mean_step_s * ms:9.3f} ms/step  ({1 - s.data_fraction:.0%})",
        ]
        if s.device_busy_fraction is not None:
            lines.append(f"  GPU busy           {s.device_busy_fraction:9.0%} of each step")
        if s.syncs_per_step is not None:
            lines.append(
                f"  host-device syncs  {s.syncs_per_step:9.1f} per step (counted on {s.sampled_steps} steps)"
            )
        if s.samples_per_s is not None:
            lines.append(f"  throughput         {s.samples_per_s:9.1f} samples/s")
        lines.append(f"  peak memory        {s.peak_memory}")
        if self.advice:
            lines.append("What would help, most valuable first:")
            for i, a in enumerate(self.advice, 1):
                lines.append(f"  {i}. {a}")
        else:
            lines.append("No tip applies: the loop is neither data-bound nor sync-bound.")
        return "\n".join(lines)


def profile_steps(
    fn: F | None = None,
    *,
    warmup: int = 1,
    sample_every: int | None = None,
    debug: bool = False,
    model: torch.nn.Module | None = None,
    enabled: bool = True,
) -> Any:
    """Profile the steps of a training loop and advise which speedups tip would help.

    Spellings::

        with profile_steps() as prof:            # time the data wait and each step
            for batch in prof.iter(loader):
                train_step(*batch)
        print(prof.report())

        @profile_steps                            # each call is a step; train_step.profiler.report()
        def train_step(x, y): ...

    Args:
        fn: a step function, when used as a bare decorator.
        warmup: first steps left out of the means (lazy initialisation, autotuning). Default 1.
        sample_every: count host-device syncs on every n-th step after warm-up. Default None: the first
            step after warm-up, then as rarely as keeps the sampling's extra cost under about 1% of the run.
            Sampled steps are slower and left out of the means; ``debug=True`` samples every step.
        debug: also run the mistake detectors (see :func:`check`); slower, for a few hundred steps.
        model: the (DDP-wrapped) model, for the ``no_sync`` detector in debug mode.
        enabled: False makes every part a no-op: ``iter`` returns the plain iterator, the decorator
            returns the function unchanged.

    Returns:
        A :class:`StepProfiler` (a context manager and a decorator), or the decorated ``fn``.

    Raises:
        ValueError: ``warmup`` < 0 or ``sample_every`` < 1.
        TypeError: ``model`` is not a module; a class is decorated.

    Example:
        >>> with profile_steps(warmup=0) as prof:
        ...     for x in prof.iter([torch.ones(4, 2)] * 3):
        ...         _ = (x * 2).sum()
        >>> len(prof.steps), prof.steps[0].samples
        (3, 4)
    """
    profiler = StepProfiler(
        warmup=warmup, sample_every=sample_every, debug=debug, model=model, enabled=enabled
    )
    if fn is not None:
        return profiler(fn)
    return profiler


def check(*, model: torch.nn.Module | None = None, enabled: bool = True) -> StepProfiler:
    """Watch a loop for the classic mistakes; each warns once (a ``SpeedupsWarning``) with the fix as code.

    Same as ``profile_steps(debug=True, model=model)``::

        with check(model=ddp_model) as chk:
            for batch in chk.iter(loader):
                ...

    Detects: a loss tensor kept alive with its autograd graph across steps; a ``DistributedSampler``
    iterated again with the same epoch (``set_epoch`` forgotten); ``optimizer.step()`` called by hand on a
    micro-step where ``@accumulate`` does not step; ``no_sync()`` around backward but not forward (``model``
    must be the DDP-wrapped model). Slower than plain profiling: every step is sampled.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``enabled`` is not a bool.
        SpeedupsError: the same checker is entered twice.

    Example:
        >>> import warnings
        >>> model = torch.nn.Linear(2, 1)
        >>> losses = []
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     with check() as chk:
        ...         for x in chk.iter([torch.randn(4, 2) for _ in range(3)]):
        ...             loss = model(x).pow(2).mean()
        ...             loss.backward()
        ...             losses.append(loss)  # the mistake: keeps each step's graph
        >>> any("losses.append(loss.detach())" in str(w.message) for w in caught)
        True
    """
    return StepProfiler(debug=True, model=model, enabled=enabled)


# ----------------------------------------------------------------------------------------------- helpers
def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        return leaf

    tree_map(visit, obj)
    return found


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):  # the common cases without walking a tree
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0]) if batch[0].dim() else None
    for t in _tensors(batch):
        if t.dim():
            return int(t.shape[0])
    return None


def _device_frees() -> int:
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_free", 0))


def _peak_memory() -> str:
    parts = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated on cuda")
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = rss if sys.platform == "darwin" else rss * 1024
        parts.append(f"{rss_bytes / 2**20:.0f} MiB process RSS (peak)")
    except ImportError:  # Windows
        pass
    return "; ".join(parts) or "not measurable here"

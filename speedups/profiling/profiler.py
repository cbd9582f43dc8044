"""Tip 10: see where each training step's time goes, and which tip would help.

``profile_steps()`` times every step of a plain loop (time waiting for the batch vs time in the step),
counts host-device syncs on a few sampled steps, and hands what it saw to the advice rules
(:mod:`speedups.profiling.advice`). With ``debug=True`` (or :func:`speedups.check`) it also feeds the mistake
detectors of :mod:`speedups.profiling.mistakes` while the loop runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import wrapt

from speedups._helpers import validate
from speedups._helpers.hardware import cpu_fp32_matmul_rate, cpu_has_native_bf16, usable_cpus
from speedups._helpers.wrappers import unwrap
from speedups.errors import SpeedupsError
from speedups.kernels.tf32 import cudnn_allowed, matmul_allowed
from speedups.memory import checkpointed
from speedups.memory.saved_activations import SavedActivations
from speedups.profiling.activation_memory import ActivationMemory, BlockMemory
from speedups.profiling.advice import Advice, Report, Summary, advise
from speedups.profiling.gpu_activity import GpuActivity
from speedups.profiling.measure import LoaderBatchSizes, Sampling, gpus_in_use, p90, peak_memory, samples_in
from speedups.profiling.mistakes import MistakeWatcher
from speedups.profiling.plots import draw_steps

__all__ = ["StepProfiler", "StepRecord", "profile_steps"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
class _StepEvents:
    """The CUDA events around one step, one pair per GPU in use (``torch.cuda.Event`` on each GPU's current
    stream), read when the report is made: the step's GPU time is the longest span (the GPU done last)."""

    devices: list[int]
    start: list[Any]
    end: list[Any]

    @classmethod
    def begin(cls, devices: list[int]) -> _StepEvents:
        events = cls(devices, [], [])
        for index in devices:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(index))
            events.start.append(start)
            events.end.append(torch.cuda.Event(enable_timing=True))
        return events

    def finish(self) -> None:
        for index, end in zip(self.devices, self.end, strict=True):
            end.record(torch.cuda.current_stream(index))

    def seconds(self) -> float:
        """The longest start-to-end span over the GPUs, in seconds (waits for the end events)."""
        spans = []
        for start, end in zip(self.start, self.end, strict=True):
            end.synchronize()
            spans.append(start.elapsed_time(end) / 1000.0)
        return max(spans)


@dataclass(slots=True)
class StepRecord:
    """One profiled step.

    Attributes:
        data_s: seconds spent waiting for this step's batch (``prof.iter``), or, for a step recorded only by
            the decorator, the seconds between the end of the previous step and the start of this one.
        step_s: seconds of host wall time in the step itself.
        samples: samples in the batch: ``batch_size=`` if given, else the DataLoader's batch size, else the
            leading dimension of the first tensor of the batch; None if unknown.
        sampled: whether syncs were counted on this step (then slower, so left out of the means).
        cache_frees: CUDA memory blocks returned to the driver during a sampled step.
        cpu_bf16_matmuls: bf16 matrix ops seen on the CPU during a sampled step.
        cpu_fp32_matmul_flops: the FLOPs of fp32 matrix ops on the CPU during a sampled step (forward and
            backward, estimated from the forward calls' shapes); 0.0 on steps not sampled.
        syncs: host-device syncs counted on a sampled step (``.item()``, ``float(t)``, ``.tolist()``, ...).
        device_s: the step's span on the GPU from CUDA events (idle gaps included), filled in when the
            report is made.
        kernel_s: on a sampled GPU step, the seconds the busiest GPU ran kernels, copies and memsets
            (``torch.profiler``'s CUDA activity, overlaps counted once); None elsewhere or if it could not
            be traced. The summary's ``device_busy_fraction`` is their mean over the mean step time.
        gpu: on a sampled GPU step, what the trace says the busiest GPU ran (kernels, fp32 matrix work,
            NCHW convolutions, copies on the compute stream); None where ``kernel_s`` is.
        tf32: with ``gpu``, whether fp32 matmuls and cuDNN (in that order) could use TF32 during the step.
    """

    data_s: float
    step_s: float
    samples: int | None = None
    sampled: bool = False
    syncs: int | None = None
    device_s: float | None = None
    cache_frees: int | None = None
    cpu_bf16_matmuls: int = 0
    cpu_fp32_matmul_flops: float = 0.0
    kernel_s: float | None = None
    gpu: GpuActivity | None = None
    tf32: tuple[bool, bool] | None = None
    claimed_s: float | None = field(default=None, repr=False)  # time in decorated calls within the step
    _events: _StepEvents | None = field(default=None, repr=False)


class _ProfiledFunction(wrapt.FunctionWrapper):
    """A step function recorded by a :class:`StepProfiler`; ``.profiler`` is that profiler."""

    _self_profiler: StepProfiler

    @property
    def profiler(self) -> StepProfiler:
        return self._self_profiler


_DEFAULTS: dict[str, Any] = dict(
    warmup=1, sample_every=None, debug=False, model=None, batch_size=None, enabled=True
)


def _call_as_written(given: dict[str, Any]) -> str:
    """``profile_steps(...)`` with the arguments that differ from the defaults; a module by its class name."""
    shown = [
        f"{k}=<{type(v).__name__}>" if isinstance(v, torch.nn.Module) else f"{k}={v!r}"
        for k, v in given.items()
        if not (type(v) is type(_DEFAULTS[k]) and v == _DEFAULTS[k])
    ]
    return f"profile_steps({', '.join(shown)})"


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
    CUDA's sync debug mode (``torch.cuda.set_sync_debug_mode``) also counts the syncs inside torch, and
    ``torch.profiler`` traces the GPU's kernels for its busy time (not over a profiler of yours). A sampled
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
        batch_size: int | None = None,
        enabled: bool = True,
    ) -> None:
        given = dict(
            warmup=warmup, sample_every=sample_every, debug=debug, model=model, batch_size=batch_size,
            enabled=enabled,
        )  # fmt: skip
        with validate.arguments(_call_as_written(given)):
            validate.integer(warmup, "warmup", minimum=0, example="1")
            validate.integer(sample_every, "sample_every", minimum=1, none_ok=True, example="50")
            validate.flag(debug, "debug")
            validate.flag(enabled, "enabled")
            validate.integer(batch_size, "batch_size", minimum=1, none_ok=True, example="64")
            validate.instance(
                model, torch.nn.Module, "model", what="an nn.Module (the DDP-wrapped model)", none_ok=True
            )
        self.enabled = enabled
        self.warmup = warmup
        self.sample_every = 1 if debug else sample_every
        self._next_sample_at = 0.0  # adaptive sampling: perf_counter time before which no step is sampled
        self._last_plain_s: float | None = None  # the latest unsampled step's time
        self.debug = debug
        self.model = model
        self.batch_size = batch_size
        self._entered = False
        self.steps: list[StepRecord] = []
        """Every recorded step, warm-up steps included."""
        self._start: float | None = None
        self._last_end: float | None = None
        self._open: StepRecord | None = None  # the step `iter` has handed out and not yet closed
        self._loader_workers: int | None = None
        self._mistakes = MistakeWatcher(model) if debug else None
        self._gpus: list[int] | None = None  # the CUDA devices whose streams the step events time
        self._counting: SavedActivations | None = None  # counts the activations of the step running now
        self.activations: SavedActivations | None = None
        """With ``model=``: the bytes kept for backward on the first sampled step, per block (else None)."""

    # ------------------------------------------------------------------------ context manager / decorator
    def __enter__(self) -> StepProfiler:
        if self._entered or (self._mistakes is not None and self._mistakes.active):
            raise SpeedupsError(
                "profile_steps(): this profiler is already entered (`with prof:` inside `with prof:`), which "
                "would restart its clock and mix two loops' steps. Use one `with` block per profiler, or "
                "make a new one: `with profile_steps() as prof:`."
            )
        self._entered = True
        if self.enabled:
            self._start = time.perf_counter()
            self._last_end = self._start
            if self._mistakes is not None:
                self._mistakes.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._entered = False
        if self._mistakes is not None:
            self._mistakes.stop()

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
            size = self.batch_size if self.batch_size is not None else samples_in((args, kwargs))
            record, sampling = self._begin(start - last, size, start)
            try:
                return wrapped(*args, **kwargs)
            finally:
                self._end(record, start, sampling)

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
        sizes = None if self.batch_size is not None else LoaderBatchSizes.make(iterable)
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
                if self._mistakes is not None:
                    self._mistakes.new_pass(iterable)
            if self.batch_size is not None:
                size: int | None = self.batch_size
            else:
                size = sizes.next() if sizes is not None else samples_in(batch)
            record, sampling = self._begin(t1 - t0, size, t1)
            self._open = record
            try:
                yield batch
            finally:
                self._open = None
                self._end(record, t1, sampling)

    # ------------------------------------------------------------------------------------ step bookkeeping
    def _begin(self, data_s: float, samples: int | None, now: float) -> tuple[StepRecord, Sampling | None]:
        index = len(self.steps)
        if index < self.warmup:
            sampled = False
        elif self.sample_every is not None:
            sampled = (index - self.warmup) % self.sample_every == 0
        else:
            sampled = now >= self._next_sample_at
        record = StepRecord(data_s, 0.0, samples, sampled)
        self.steps.append(record)
        if torch.cuda.is_initialized():  # cheap flag check; True only once CUDA is in use
            if index in (0, self.warmup) or self._gpus is None:  # not the current device only: every GPU
                self._gpus = gpus_in_use()  # holding memory (a model on cuda:1, shard_model's parts)
            record._events = _StepEvents.begin(self._gpus)
        if not sampled:
            return record, None
        if self.model is not None and self.activations is None and self._counting is None:
            self._counting = SavedActivations(self.model).__enter__()
        return record, Sampling.begin(on_gpu=record._events is not None, keep_losses=self.debug)

    def _end(self, record: StepRecord, start: float, sampling: Sampling | None) -> None:
        end = time.perf_counter()
        record.step_s = end - start if record.claimed_s is None else record.claimed_s
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self.activations, self._counting = self._counting, None
        self._last_end = end
        if not record.sampled:
            self._last_plain_s = record.step_s
        elif self.sample_every is None:
            # The next sample waits until this one's extra cost is 1% of the time in between (and at least
            # 10 steps' worth), so sampling never costs more than about 1% of the run.
            extra = max(record.step_s - (self._last_plain_s or 0.0), 0.0)
            self._next_sample_at = end + max(100 * extra, 10 * (self._last_plain_s or record.step_s))
        if record._events is not None:
            record._events.finish()
        loss_refs = None
        if sampling is not None:
            counts = sampling.end()
            record.syncs, record.cpu_bf16_matmuls = counts.syncs, counts.cpu_bf16_matmuls
            record.cpu_fp32_matmul_flops = counts.cpu_fp32_matmul_flops
            record.cache_frees, loss_refs = counts.cache_frees, counts.loss_refs
            record.gpu = counts.gpu
            if counts.gpu is not None:
                record.kernel_s = counts.gpu.busy_s
                record.tf32 = (matmul_allowed(), cudnn_allowed())
        if self._mistakes is not None:
            self._mistakes.step_ended(loss_refs)

    # ------------------------------------------------------------------------------------------ results
    @property
    def samples_per_s(self) -> float | None:
        """The last finished step's samples per second (its batch over its data wait and step time): a
        host float, no sync, for a per-step log (``logger.log(step, samples_per_s=prof.samples_per_s)``);
        None before a step with a known batch size finished."""
        last = self.steps[-1] if self.steps else None
        if last is None or last.samples is None:
            return None
        seconds = last.data_s + last.step_s
        return last.samples / seconds if seconds > 0 else None

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
                r.device_s = r._events.seconds()
        data_times, step_times = [r.data_s for r in timed], [r.step_s for r in timed]
        mean_data, mean_step = statistics.fmean(data_times), statistics.fmean(step_times)
        total = mean_data + mean_step
        sampled = [r for r in self.steps if r.syncs is not None]
        sizes = [r.samples for r in timed if r.samples is not None]
        device_times = [r.device_s for r in timed if r.device_s is not None]
        busy = [r.kernel_s for r in self.steps if r.kernel_s is not None]  # sampled steps only
        frees = [r.cache_frees for r in self.steps if r.cache_frees is not None]
        return Summary(
            steps=len(self.steps),
            mean_data_s=mean_data,
            mean_step_s=mean_step,
            median_data_s=statistics.median(data_times),
            median_step_s=statistics.median(step_times),
            p90_data_s=p90(data_times),
            p90_step_s=p90(step_times),
            data_fraction=mean_data / total if total > 0 else 0.0,
            syncs_per_step=statistics.fmean(r.syncs or 0 for r in sampled) if sampled else None,
            sampled_steps=len(sampled),
            samples_per_s=(statistics.fmean(sizes) / total) if sizes and total > 0 else None,
            mean_batch=statistics.fmean(sizes) if sizes else None,
            device_type="cuda" if device_times else "cpu",
            device_busy_fraction=min(statistics.fmean(busy) / total, 1.0) if busy and total else None,
            cache_frees_per_step=statistics.fmean(frees) if frees else None,
            cpu_bf16_matmuls=sum(r.cpu_bf16_matmuls for r in self.steps),
            native_cpu_bf16=cpu_has_native_bf16(),
            cpu_fp32_matmul_share=self._cpu_fp32_matmul_share(sampled, mean_step),
            loader_workers=self._loader_workers,
            usable_cpus=usable_cpus(),
            peak_memory=peak_memory(),
            activations=self._activation_memory(),
            **self._gpu_shares(total),
        )

    @staticmethod
    def _cpu_fp32_matmul_share(sampled: list[StepRecord], mean_step: float) -> float | None:
        """The share of the mean step that the sampled steps' fp32 matrix work on the CPU takes at this CPU's
        fp32 matmul rate; None unless the CPU computes bf16 natively and no bf16 matrix work was seen (the
        advice is then to move that work to bf16)."""
        flops = [r.cpu_fp32_matmul_flops for r in sampled]
        if not flops or not any(flops) or mean_step <= 0 or not cpu_has_native_bf16():
            return None
        if any(r.cpu_bf16_matmuls for r in sampled):
            return None
        return min(statistics.fmean(flops) / cpu_fp32_matmul_rate() / mean_step, 1.0)

    def _gpu_shares(self, total: float) -> dict[str, Any]:
        """The Summary's fields from the GPU trace of the sampled steps: the mean seconds of each kind of
        work over the mean step (``total``), kernels per step; nothing without a trace."""
        traced = [(r.gpu, r.tf32) for r in self.steps if r.gpu is not None and r.tf32 is not None]
        if not traced or total <= 0:
            return {}
        gpus = [t for t, _ in traced]
        kernels = sum(t.kernels for t in gpus)

        def share(seconds: list[float]) -> float:
            return min(statistics.fmean(seconds) / total, 1.0)

        fp32 = [t.without_tf32_s(matmul_tf32=m, cudnn_tf32=c) for t, (m, c) in traced]
        return dict(
            gpu_kernels_per_step=kernels / len(gpus),
            mean_kernel_s=sum(t.kernel_sum_s for t in gpus) / kernels if kernels else None,
            fp32_matmul_fraction=share(fp32),
            nchw_conv_fraction=share([t.nchw_conv_s for t in gpus]),
            htod_compute_fraction=share([t.htod_compute_s for t in gpus]),
            tf32_capable=all(torch.cuda.get_device_capability(i) >= (8, 0) for i in self._gpus or ()),
        )

    def _activation_memory(self) -> ActivationMemory | None:
        counted = self.activations
        if counted is None or self.model is None:
            return None
        done = set(checkpointed(self.model))
        kept, inputs, seconds = counted.bytes_by_block, counted.input_bytes, counted.seconds_by_block
        blocks = tuple(
            BlockMemory(name, kept[name], inputs[name], seconds[name], checkpointed=name in done)
            for name, _ in counted.blocks
        )
        params = sum(p.numel() * p.element_size() for p in unwrap(self.model).parameters())
        return ActivationMemory(counted.peak_bytes, counted.total_bytes, params, blocks)

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

        Draws on a figure of its own with matplotlib's Agg canvas: the process's backend is left alone.

        Raises:
            ImportError: matplotlib is not installed (``pip install 'speedups[examples]'``).
            SpeedupsError: no step was recorded yet.
        """
        return draw_steps(Path(path), self.steps, self.summary().data_fraction)


def profile_steps(
    fn: F | None = None,
    *,
    warmup: int = 1,
    sample_every: int | None = None,
    debug: bool = False,
    model: torch.nn.Module | None = None,
    batch_size: int | None = None,
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
        debug: also run the mistake detectors (see :func:`speedups.check`); slower, for a few hundred steps.
        model: the (DDP-wrapped) model. On the first sampled step the bytes of activations kept for backward
            are counted per block (``saved_tensors_hooks``; exact, CPU or GPU) with each block's forward
            time: the report lists them and the advice names the blocks to checkpoint. Also the ``no_sync``
            detector's model in debug mode.
        batch_size: samples per step, for the throughput. None: the ``DataLoader``'s ``batch_size`` (short
            last batch included), else the leading dimension of the batch's first tensor.
        enabled: False makes every part a no-op: ``iter`` returns the plain iterator, the decorator
            returns the function unchanged.

    Returns:
        A :class:`StepProfiler` (a context manager and a decorator), or the decorated ``fn``.

    Raises:
        ValueError: ``warmup`` < 0, ``sample_every`` < 1 or ``batch_size`` < 1.
        SpeedupsError: a profiler entered again while it is open (``with prof:`` inside ``with prof:``).
        TypeError: ``warmup`` or ``sample_every`` not an int; ``debug`` or ``enabled`` not a bool; ``model``
            not a module; a class is decorated.

    Example:
        >>> with profile_steps(warmup=0) as prof:
        ...     for x in prof.iter([torch.ones(4, 2)] * 3):
        ...         _ = (x * 2).sum()
        >>> len(prof.steps), prof.steps[0].samples
        (3, 4)
    """
    profiler = StepProfiler(
        warmup=warmup, sample_every=sample_every, debug=debug, model=model, batch_size=batch_size,
        enabled=enabled,
    )  # fmt: skip
    return profiler(fn) if fn is not None else profiler

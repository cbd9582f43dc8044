"""Time one DataLoader setting without moving the loader's sampler, generator or global RNG streams.

The measuring half of :func:`speedups.tune_loader`: a record of one timed setting (:class:`LoaderTrial`), the
index batches timing reads instead of the loader's sampler, and rebuilding a loader with other worker
settings but the same sampling.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from speedups.data.persistence import build_loader, unwrapped
from speedups.data.sample_keys import SampleKeys
from speedups.data.workers import dataloader_parameters
from speedups.device import to_device

__all__ = [
    "TUNED",
    "LoaderTrial",
    "better",
    "copy_batch",
    "rebuild_loader",
    "sampler_generators",
    "sampling_kwargs",
    "time_setting",
    "timing_sampling",
    "uses_default_batch_sampler",
]

TUNED = ("num_workers", "pin_memory", "prefetch_factor")
"""The DataLoader arguments ``tune_loader`` chooses."""


@dataclass(frozen=True)
class LoaderTrial:
    """One timed setting of :func:`tune_loader`.

    Attributes:
        num_workers: worker processes (0: the main process loads).
        pin_memory: batches copied to page-locked memory.
        prefetch_factor: batches each worker loads ahead (None without workers).
        batches_per_s: measured rate after warm-up (batches per second), the better of two runs when the
            setting was timed twice; 0.0 when nothing was measured.
        batches: batches that rate is computed from (warm-up and the first third after it excluded).
        seconds: wall time spent on this setting, worker start-up and warm-up included.
        num_threads: torch's compute threads in this process during the trial (``torch.get_num_threads()``).
    """

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    batches_per_s: float
    batches: int
    seconds: float
    num_threads: int | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """The DataLoader arguments this trial used, and its ``num_threads``."""
        return {**{n: getattr(self, n) for n in TUNED}, "num_threads": self.num_threads}


def uses_default_batch_sampler(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s batch sampler is the one ``DataLoader`` built from its ``batch_size``."""
    bs = loader.batch_sampler
    return type(bs) is BatchSampler and bs.sampler is loader.sampler and bs.batch_size == loader.batch_size


def sampling_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """The arguments that decide which samples come out, and in which order, exactly as in ``loader``: the
    user's sampler or batch sampler (a rebuilt loader wraps them anew)."""
    if isinstance(loader.dataset, IterableDataset):
        return {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.batch_sampler is None:  # automatic batching disabled
        return {"batch_size": None, "sampler": unwrapped(loader.sampler)}
    if uses_default_batch_sampler(loader):
        sampler = unwrapped(loader.sampler)
        return {"batch_size": loader.batch_size, "sampler": sampler, "drop_last": loader.drop_last}
    return {"batch_size": 1, "batch_sampler": unwrapped(loader.batch_sampler)}


def rebuild_loader(
    loader: DataLoader[Any],
    sampling: Mapping[str, Any],
    *,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int | None,
    persistent_workers: bool | str,
    generator: torch.Generator | None,
) -> DataLoader[Any]:
    """A DataLoader like ``loader`` (the user's dataset, collate_fn, timeout, worker_init_fn, context, ...)
    with the given sampling and worker settings (``persistent_workers`` may be
    :data:`~speedups.data.persistence.EXACT`)."""
    kwargs: dict[str, Any] = dict(sampling)
    kwargs.update(
        num_workers=num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=pin_memory,
        timeout=loader.timeout if num_workers > 0 else 0,
        worker_init_fn=loader.worker_init_fn,
        generator=generator,
    )
    if num_workers > 0:
        kwargs.update(
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
        )
    params = dataloader_parameters()
    for name in ("pin_memory_device", "in_order"):
        if name in params and hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    return build_loader(DataLoader, unwrapped(loader.dataset), **kwargs)


class _TimingBatches:
    """``count`` batches of consecutive indices of ``batch_size``, wrapping around ``n`` items.

    Timing reads these instead of the loader's sampler, so no shuffling generator is consumed.
    """

    def __init__(self, n: int, batch_size: int | None, count: int) -> None:
        self.n, self.batch_size, self.count = n, batch_size, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        step = self.batch_size or 1
        for i in range(self.count):
            if self.batch_size is None:
                yield i % self.n
            else:
                yield [(i * step + j) % self.n for j in range(step)]


class _Cycle:
    """Replay a fixed list of index batches ``count`` times over (for a custom ``batch_sampler``)."""

    def __init__(self, batches: Sequence[Any], count: int) -> None:
        self.batches, self.count = list(batches), count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.count):
            yield self.batches[i % len(self.batches)]


def sampler_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """Generators held by the loader's sampler and batch sampler, and by the samplers they wrap (a batch
    sampler's ``sampler``, a ``sample_seeds`` wrapper's): a custom batch sampler is read once."""
    found: list[torch.Generator] = []
    for obj in (loader.sampler, loader.batch_sampler):
        for _ in range(4):  # a few wrappers deep
            g = getattr(obj, "generator", None)
            if isinstance(g, torch.Generator) and g is not loader.generator and g not in found:
                found.append(g)
            obj = getattr(obj, "sampler", None)
    return found


def timing_sampling(loader: DataLoader[Any]) -> dict[str, Any]:
    """Sampling arguments for timing runs: long enough for any trial, never touching the loader's sampler
    state that matters (a custom batch sampler is read once, under preserved RNG states)."""
    count = 100_000  # an upper bound on batches per trial; trials stop on time long before
    if isinstance(loader.dataset, IterableDataset):
        return sampling_kwargs(loader)
    if loader.batch_sampler is None or uses_default_batch_sampler(loader):
        n = len(loader.dataset)  # type: ignore[arg-type]
        if n == 0:
            return sampling_kwargs(loader)
        batches = _TimingBatches(n, loader.batch_size, count)
        if loader.batch_sampler is None:
            return {"batch_size": None, "sampler": batches}
        return {"batch_size": 1, "batch_sampler": batches}
    source = unwrapped(loader.batch_sampler)  # the user's: iterating a wrapper would draw a base seed
    if isinstance(source, SampleKeys):  # sample_seeds: read the user's batch sampler, not the pass counter
        source = source.sampler
    sample = []
    for batch in source:
        sample.append(batch)
        if len(sample) >= 256:
            break
    if not sample:
        return sampling_kwargs(loader)
    return {"batch_size": 1, "batch_sampler": _Cycle(sample, count)}


def copy_batch(batch: Any, device: torch.device, pinned: bool) -> Any:
    """What the training loop does with each batch on a GPU: :func:`~speedups.to_device`, asynchronous from
    the pinned memory of a loader with ``pin_memory`` (``pinned``), a blocking copy from pageable memory."""
    return to_device(batch, device, non_blocking=pinned)


def time_setting(
    loader: DataLoader[Any],
    sampling: Mapping[str, Any],
    setting: tuple[int, bool, int | None],
    share: float,
    generator: torch.Generator,
    device: torch.device | None = None,
    step: Callable[[Any], object] | None = None,
    num_threads: int | None = None,
) -> LoaderTrial:
    """Time one ``(num_workers, pin_memory, prefetch_factor)`` setting for about ``share`` seconds.

    Workers start, a warm-up of ``num_workers * prefetch_factor`` batches (at least 1) is read, then batches
    are counted until the share is spent (at least 4). With a ``device``, each batch is also copied there
    (:func:`copy_batch`), and the last stamp waits for the copies: what pinning saves or costs is in the
    rate, as the loop pays it. With a ``step``, it is called on each batch (as copied) in this process, so
    the rate is the loop's: loading and the step competing for the same cores. ``num_threads`` sets torch's
    compute threads in this process for the trial (``torch.set_num_threads``, put back after); None keeps
    them.
    """
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        trial = _timed(loader, sampling, setting, share, generator, device, step)
    finally:
        torch.set_num_threads(threads_before)
    return dataclasses.replace(trial, num_threads=num_threads or threads_before)


def _timed(
    loader: DataLoader[Any],
    sampling: Mapping[str, Any],
    setting: tuple[int, bool, int | None],
    share: float,
    generator: torch.Generator,
    device: torch.device | None,
    step: Callable[[Any], object] | None,
) -> LoaderTrial:
    """:func:`time_setting` at the thread count in force."""
    workers, pin, prefetch = setting
    start = time.perf_counter()
    timing = rebuild_loader(
        loader,
        sampling,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=prefetch,
        persistent_workers=False,
        generator=generator,
    )
    warmup = max(1, workers * (prefetch or 0))
    stamps: list[float] = []  # time after each batch past the warm-up
    it = iter(timing)
    try:
        for _ in range(warmup):
            _use(next(it), device, pin, step)
        stamps.append(time.perf_counter())
        while time.perf_counter() - start < share or len(stamps) < 4:
            _use(next(it), device, pin, step)
            stamps.append(time.perf_counter())
    except StopIteration:
        pass
    finally:
        del it  # shuts the workers down now
    if device is not None and device.type == "cuda" and stamps:
        torch.cuda.synchronize(device)  # the copies (and steps) still in flight belong to the last batches
        stamps[-1] = time.perf_counter()
    end = time.perf_counter()
    # The rate over the later two thirds: the first batches after the warm-up may already be waiting in
    # the prefetch queue and would flatter settings with more batches in flight.
    first = (len(stamps) - 1) // 3
    batches = len(stamps) - 1 - first
    elapsed = stamps[-1] - stamps[first] if stamps else 0.0
    rate = batches / elapsed if batches > 0 and elapsed > 0 else 0.0
    return LoaderTrial(workers, pin, prefetch, rate, batches, end - start)


def _use(batch: Any, device: torch.device | None, pinned: bool, step: Callable[[Any], object] | None) -> None:
    """What the loop does with a batch: copy it to the device (with CUDA), then run the step (if given)."""
    if device is not None:
        batch = copy_batch(batch, device, pinned)
    if step is not None:
        step(batch)


def better(old: LoaderTrial | None, new: LoaderTrial) -> LoaderTrial:
    """Merge two runs of one setting: the better rate (and its batch count), the time of both."""
    if old is None:
        return new
    best = new if new.batches_per_s > old.batches_per_s else old
    return dataclasses.replace(best, seconds=old.seconds + new.seconds)

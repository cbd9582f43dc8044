"""Tips 1-2: a DataLoader with fast defaults, and ``num_workers`` chosen by measurement, not by folklore.

``fast_loader(dataset, batch_size)`` returns a plain :class:`torch.utils.data.DataLoader` with worker
processes sized to the CPUs this process may use, persistent workers, pinned memory only where CUDA is used,
and worker seeding that gives every worker and every epoch its own ``numpy`` and ``random`` streams.
``tune_loader(loader)`` times a few settings for a few batches each and returns a rebuilt loader with the
fastest one, plus a report; the batches it yields, and their order, never change.

Both check, before any worker starts, that what a worker needs can be pickled under the ``spawn`` and
``forkserver`` start methods (the default on macOS, Windows and Python 3.14), so a lambda ``collate_fn``
fails early with a message that names it, instead of a ``PicklingError`` in the middle of an epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import multiprocessing
import pickle
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, get_worker_info

from speedups import _env
from speedups._hardware import usable_cpus
from speedups._rng import preserved_rng
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["fast_loader", "tune_loader", "LoaderReport"]

# Start methods that send the dataset, collate_fn and worker_init_fn to each worker by pickling them.
_PICKLING_START_METHODS = ("spawn", "forkserver")
_TUNED = ("num_workers", "pin_memory", "prefetch_factor")
# A setting within this fraction of the fastest counts as a tie; ties go to fewer workers (less memory).
_TIE = 0.05


# ------------------------------------------------------------------------------------------ worker seeding
def _seed_worker(worker_id: int, init_fn: Callable[[int], object] | None = None) -> None:
    """Seed ``numpy`` and ``random`` in a DataLoader worker from torch's worker seed, then call ``init_fn``.

    torch gives each worker ``base_seed + worker_id`` as its torch seed (``get_worker_info().seed``), where
    ``base_seed`` is drawn from the loader's ``generator`` (or the global torch RNG) each time an epoch's
    workers start. Deriving the other two streams from it makes them distinct across workers and epochs and
    reproducible from the generator's seed. Module-level (not a closure) so it pickles under ``spawn``.
    """
    info = get_worker_info()
    seed = info.seed if info is not None else torch.initial_seed()
    random.seed(f"speedups-worker-{seed}")  # str seeds go through SHA-512: stable across runs
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(np.random.SeedSequence(seed).generate_state(4))
    if init_fn is not None:
        init_fn(worker_id)


# ------------------------------------------------------------------------------------------ small helpers
def _cpus_per_process() -> int:
    """CPUs this process may run on (its affinity mask), shared among the local processes of the job."""
    return usable_cpus() // max(1, _env.local_world_size())  # 0 with more local processes than CPUs


def _start_method(context: object) -> str:
    """The start method workers will use: the loader's context, else the process default (nothing is set)."""
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())  # type: ignore[attr-defined]
    # get_start_method() without allow_none would fix the default for the whole process: never call it.
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


class _Discard:
    """A file that drops what is written: pickling into it checks picklability without holding the bytes."""

    def write(self, data: bytes) -> int:
        return len(data)


def _unpicklable(objects: Mapping[str, object]) -> tuple[str, object, Exception] | None:
    """The first of ``objects`` (name -> object) that plain pickle cannot serialise, with the error."""
    for name, obj in objects.items():
        if obj is None:
            continue
        try:
            pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as err:
            return name, obj, err
    return None


def _worker_payload(dataset: object, collate_fn: object, worker_init_fn: object) -> dict[str, object]:
    return {"dataset": dataset, "collate_fn": collate_fn, "worker_init_fn": worker_init_fn}


def _short_repr(obj: object, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.cache
def _dataloader_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(DataLoader.__init__).parameters)


def _default_prefetch(num_workers: int) -> int:
    """Batches each worker loads ahead: at least 2 (torch's default), and at least 4 in flight in total."""
    return max(2, math.ceil(4 / num_workers))


# ------------------------------------------------------------------------------------------ fast_loader
def fast_loader(
    dataset: Any,
    batch_size: int | None = 1,
    *,
    shuffle: bool = False,
    num_workers: int | str = "auto",
    seed: int | None = None,
    **dataloader_kwargs: Any,
) -> DataLoader[Any]:
    """Build a plain ``torch.utils.data.DataLoader`` with defaults that keep the training step fed.

    What changes against ``DataLoader(dataset, batch_size, shuffle=shuffle)``:

    - ``num_workers="auto"``: one worker per CPU this process may use (``os.sched_getaffinity``, else
      ``os.cpu_count()``), divided among the local processes of a distributed job (``LOCAL_WORLD_SIZE``);
      0 when there are more local processes than CPUs.
      An ``IterableDataset`` gets 0 workers under ``"auto"`` (with one :class:`~speedups.SpeedupsWarning`):
      each worker would replay the whole stream unless the dataset shards itself by ``get_worker_info()``;
      pass ``num_workers=N`` when it does.
    - ``persistent_workers=True`` and ``prefetch_factor`` (enough for 4 batches in flight, at least 2 per
      worker) when there are workers: no worker start-up cost at each epoch.
    - ``pin_memory=True`` only when CUDA is available (page-locked host memory makes host-to-GPU copies
      asynchronous; without CUDA it only costs memory).
    - ``worker_init_fn``: seeds ``numpy`` and ``random`` in each worker from torch's per-worker seed
      (``get_worker_info().seed``), then calls your own ``worker_init_fn(worker_id)``. Every worker and every
      epoch draws its own numbers (the classic bug: forked workers sharing one numpy state and producing
      identical "random" augmentations), and a run is reproducible from ``seed`` or ``generator``. With
      persistent workers each worker's streams simply continue into the next epoch.
    - Under the ``spawn`` and ``forkserver`` start methods, the dataset, ``collate_fn`` and
      ``worker_init_fn`` are test-pickled here, before any worker starts.

    Any other keyword goes to ``DataLoader`` unchanged and wins over these defaults. When it does not help:
    a dataset already in memory as tensors (``TensorDataset``) is indexed faster than workers can ship it;
    measure with :func:`tune_loader`.

    Args:
        dataset: a map-style or iterable-style dataset.
        batch_size: samples per batch (a positive int), or None to disable automatic batching.
        shuffle: reshuffle the sample order every epoch.
        num_workers: ``"auto"`` (see above) or a number of worker processes >= 0.
        seed: seed for a new ``torch.Generator`` that drives shuffling and the workers' seeds; do not pass
            with ``generator=``. None: the global torch RNG (reproducible after ``torch.manual_seed``).
        **dataloader_kwargs: any other ``DataLoader`` argument (``collate_fn``, ``drop_last``, ``sampler``,
            ``generator``, ``multiprocessing_context``, ``pin_memory``, ``prefetch_factor``, ...).

    Returns:
        A ``torch.utils.data.DataLoader``; nothing about it is specific to speedups. Its ``worker_init_fn``
        is picklable (a module-level function, or a ``functools.partial`` of one around yours).

    Raises:
        ValueError: ``batch_size`` < 1, ``num_workers`` < 0 or not ``"auto"``, or both ``seed`` and
            ``generator`` given.
        TypeError: an argument of the wrong type.
        SpeedupsError: workers would start with ``spawn``/``forkserver`` and the dataset, ``collate_fn``
            or ``worker_init_fn`` cannot be pickled (the message names it).

    Example:
        >>> loader = fast_loader(list(range(10)), batch_size=4, num_workers=0, seed=0, shuffle=True)
        >>> [len(b) for b in loader]
        [4, 4, 2]
        >>> type(loader).__name__, loader.pin_memory == torch.cuda.is_available()
        ('DataLoader', True)
    """
    said = f"fast_loader(batch_size={batch_size!r}, num_workers={num_workers!r}, seed={seed!r})"
    if not (hasattr(dataset, "__getitem__") or hasattr(dataset, "__iter__")) or isinstance(
        dataset, (str, bytes)
    ):
        raise TypeError(
            f"fast_loader(dataset={_short_repr(dataset)}): expected a map-style dataset (with __getitem__ "
            f"and __len__) or an IterableDataset, got {type(dataset).__name__}. "
            f"E.g. fast_loader(TensorDataset(x, y), 64)."
        )
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise TypeError(
            f"{said}: batch_size must be an int or None, got {type(batch_size).__name__}. "
            f"Pass e.g. batch_size=64."
        )
    if batch_size is not None and batch_size < 1:
        raise ValueError(
            f"{said}: batch_size must be at least 1. Allowed: a positive int, or None for no automatic "
            f"batching. Pass e.g. batch_size=64."
        )
    if not (num_workers == "auto" or (isinstance(num_workers, int) and not isinstance(num_workers, bool))):
        raise TypeError(
            f"{said}: num_workers must be 'auto' or an int >= 0. Pass num_workers='auto' or num_workers=4."
        )
    if isinstance(num_workers, int) and num_workers < 0:
        raise ValueError(
            f"{said}: num_workers must be >= 0 (0 loads in the main process). Allowed: 'auto' or an int "
            f">= 0. Pass num_workers='auto'."
        )
    if not isinstance(shuffle, bool):
        raise TypeError(f"{said}: shuffle must be a bool, got {shuffle!r}. Pass shuffle=True or False.")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{said}: seed must be an int or None. Pass e.g. seed=0.")
        if dataloader_kwargs.get("generator") is not None:
            raise ValueError(
                f"{said}: both seed and generator were given; they choose the same thing. Pass one: "
                f"seed=0, or generator=torch.Generator().manual_seed(0)."
            )
    unknown = sorted(set(dataloader_kwargs) - _dataloader_parameters())
    if unknown:
        raise TypeError(
            f"{said}: unknown DataLoader argument(s) {unknown}. "
            f"Allowed: {sorted(_dataloader_parameters() - {'self', 'num_workers', 'shuffle', 'batch_size'})}."
        )

    kwargs = dict(dataloader_kwargs)
    iterable = isinstance(dataset, IterableDataset)
    if num_workers == "auto":
        workers = 0 if iterable else _cpus_per_process()  # may be 0: fewer CPUs than local processes
        if iterable:
            warnings.warn(
                "fast_loader(num_workers='auto'): an IterableDataset gets 0 workers, since every worker "
                "would replay the whole stream unless the dataset shards itself with get_worker_info(). "
                "If yours does, pass num_workers=N.",
                SpeedupsWarning,
                stacklevel=2,
            )
        if workers == 0:  # settings that only mean something with workers: "auto" did not apply
            for key in ("persistent_workers", "prefetch_factor", "multiprocessing_context"):
                kwargs.pop(key, None)
    else:
        workers = int(num_workers)

    user_init = kwargs.get("worker_init_fn")
    if user_init is not None and not callable(user_init):
        raise TypeError(
            f"fast_loader(worker_init_fn={user_init!r}): expected a function of the worker id, or None."
        )
    kwargs["worker_init_fn"] = (
        _seed_worker if user_init is None else functools.partial(_seed_worker, init_fn=user_init)
    )
    if workers > 0:
        kwargs.setdefault("persistent_workers", True)
        kwargs.setdefault("prefetch_factor", _default_prefetch(workers))
        method = _start_method(kwargs.get("multiprocessing_context"))
        if method in _PICKLING_START_METHODS:
            bad = _unpicklable(_worker_payload(dataset, kwargs.get("collate_fn"), user_init))
            if bad is not None:
                name, obj, err = bad
                raise SpeedupsError(
                    f"fast_loader({name}={_short_repr(obj)}, num_workers={num_workers!r}): workers start "
                    f"with {method!r}, which pickles the {name} for each worker, and it cannot be pickled "
                    f"({type(err).__name__}: {err}). Define it at module level (no lambda, local function "
                    f"or local class), or load in the main process: num_workers=0."
                )
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    if not iterable or shuffle:
        kwargs["shuffle"] = shuffle
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, **kwargs)


# ------------------------------------------------------------------------------------------ tune_loader
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
    """

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    batches_per_s: float
    batches: int
    seconds: float

    @property
    def settings(self) -> dict[str, Any]:
        """The DataLoader arguments this trial used."""
        return {n: getattr(self, n) for n in _TUNED}


@dataclass
class LoaderReport:
    """What :func:`tune_loader` measured and chose; ``print(report)`` shows a table.

    Attributes:
        trials: every timed setting, in the order run.
        chosen: the DataLoader arguments of the returned loader (``num_workers``, ``pin_memory``,
            ``prefetch_factor``, ``persistent_workers``).
        reason: why those, in one or two sentences.
        seconds: total wall time of the tuning.
        start_method: the multiprocessing start method the workers use.
    """

    trials: list[LoaderTrial] = field(default_factory=list)
    chosen: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    start_method: str = ""

    def __str__(self) -> str:
        lines = [
            f"tune_loader: {len(self.trials)} setting(s) timed in {self.seconds:.1f} s "
            f"(start method {self.start_method!r})",
            f"{'num_workers':>11}  {'pin_memory':>10}  {'prefetch':>8}  {'batches/s':>10}  {'batches':>7}",
        ]
        for t in self.trials:
            mark = (
                "  <- chosen"
                if all(t.settings[k] == self.chosen.get(k) for k in _TUNED) and t.batches > 0
                else ""
            )
            prefetch = "-" if t.prefetch_factor is None else str(t.prefetch_factor)
            lines.append(
                f"{t.num_workers:>11}  {t.pin_memory!s:>10}  {prefetch:>8}  {t.batches_per_s:>10.1f}  "
                f"{t.batches:>7}{mark}"
            )
        chosen = ", ".join(f"{k}={v!r}" for k, v in self.chosen.items())
        lines.append(f"chosen: {chosen}")
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


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


def _uses_default_batch_sampler(loader: DataLoader[Any]) -> bool:
    bs = loader.batch_sampler
    return type(bs) is BatchSampler and bs.sampler is loader.sampler and bs.batch_size == loader.batch_size


def _sampling_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """The arguments that decide which samples come out, and in which order, exactly as in ``loader``."""
    if isinstance(loader.dataset, IterableDataset):
        return {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.batch_sampler is None:  # automatic batching disabled
        return {"batch_size": None, "sampler": loader.sampler}
    if _uses_default_batch_sampler(loader):
        return {"batch_size": loader.batch_size, "sampler": loader.sampler, "drop_last": loader.drop_last}
    return {"batch_size": 1, "batch_sampler": loader.batch_sampler}


def _build(
    loader: DataLoader[Any],
    sampling: Mapping[str, Any],
    *,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int | None,
    persistent_workers: bool,
    generator: torch.Generator | None,
) -> DataLoader[Any]:
    """A DataLoader like ``loader`` (dataset, collate_fn, timeout, worker_init_fn, context, ...) with the
    given sampling and worker settings."""
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
    params = _dataloader_parameters()
    for name in ("pin_memory_device", "in_order"):
        if name in params and hasattr(loader, name):
            kwargs[name] = getattr(loader, name)
    return DataLoader(loader.dataset, **kwargs)


def _check_tune_args(loader: object, max_seconds: object, candidates: object) -> list[dict[str, Any]] | None:
    said = f"tune_loader(max_seconds={max_seconds!r}, candidates={candidates!r})"
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"tune_loader(loader={_short_repr(loader)}): expected a torch.utils.data.DataLoader, got "
            f"{type(loader).__name__}. Pass the loader itself, e.g. tune_loader(DataLoader(ds, 64))."
        )
    if type(loader) is not DataLoader:
        raise TypeError(
            f"tune_loader(loader={type(loader).__name__}): a DataLoader subclass would be rebuilt as a plain "
            f"DataLoader and lose what the subclass adds (a DistributedLoader would stop advancing its "
            f"epoch). Tune the plain loader first, then wrap it: "
            f"loader = distributed(tune_loader(loader)[0])."
        )
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)):
        raise TypeError(f"{said}: max_seconds must be a number of seconds. Pass e.g. max_seconds=20.")
    if not (math.isfinite(max_seconds) and max_seconds > 0):
        raise ValueError(
            f"{said}: max_seconds must be a positive, finite number of seconds. Pass e.g. max_seconds=20."
        )
    if candidates is None:
        return None
    example = "candidates=[{'num_workers': 0}, {'num_workers': 2, 'prefetch_factor': 4}]"
    if (
        isinstance(candidates, (str, bytes, Mapping))
        or not isinstance(candidates, Sequence)
        or not candidates
    ):
        raise TypeError(
            f"{said}: candidates must be a non-empty list of dicts, or None. Pass e.g. {example}."
        )
    out = []
    for cand in candidates:
        if not isinstance(cand, Mapping) or not set(cand) <= set(_TUNED) or "num_workers" not in cand:
            raise ValueError(
                f"{said}: each candidate is a dict with 'num_workers' and optionally 'pin_memory' and "
                f"'prefetch_factor'; got {cand!r}. Pass e.g. {example}."
            )
        w, pin, pf = cand["num_workers"], cand.get("pin_memory"), cand.get("prefetch_factor")
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"{said}: num_workers must be an int >= 0, got {w!r}. Pass e.g. {example}.")
        if pin is not None and not isinstance(pin, bool):
            raise ValueError(f"{said}: pin_memory must be a bool, got {pin!r}. Pass e.g. {example}.")
        if pf is not None and (isinstance(pf, bool) or not isinstance(pf, int) or pf < 1 or w == 0):
            raise ValueError(
                f"{said}: prefetch_factor must be an int >= 1 and only with num_workers > 0, got "
                f"{cand!r}. Pass e.g. {example}."
            )
        out.append({"num_workers": w, "pin_memory": pin, "prefetch_factor": pf})
    return out


def _default_grid(loader: DataLoader[Any]) -> list[int]:
    most = max(1, _cpus_per_process())  # measuring one worker is cheap even on a crowded node
    grid = {0, most, loader.num_workers}
    w = 1
    while w < most:
        grid.add(w)
        w *= 2
    return sorted(grid)


def _progress(total: int, enabled: bool) -> Any:
    """A tqdm bar that appears only after a second (tqdm is optional: no bar without it)."""
    if enabled:
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            pass
        else:
            return tqdm(
                total=total, desc="tune_loader", unit="setting", delay=1.0, leave=False, file=sys.stderr
            )
    return None


def tune_loader(
    loader: DataLoader[Any],
    *,
    max_seconds: float = 20.0,
    candidates: Sequence[Mapping[str, Any]] | None = None,
    progress: bool = True,
) -> tuple[DataLoader[Any], LoaderReport]:
    """Time a few loader settings on this machine and return a loader rebuilt with the fastest one.

    Each setting (``num_workers``, ``pin_memory``, ``prefetch_factor``) is timed twice, round-robin, for a
    share of ``max_seconds`` each time, and keeps its better rate (noise from other work only slows a run
    down): workers start, a warm-up of ``num_workers * prefetch_factor`` batches (at least 1) is read, then
    batches are counted until the share is spent. The default grid is 0, 1, 2, 4, ... workers up
    to the CPUs this process may use (plus the loader's own count), then ``prefetch_factor=4`` for the
    fastest, then ``pin_memory`` flipped when CUDA is available. Settings within 5% of the fastest count as a
    tie, and a tie goes to fewer workers (less memory, fewer processes).

    Only the raw loading rate is measured (no training step runs), so this helps most when loading is the
    bottleneck: CPU-heavy ``__getitem__`` (decoding, augmentation). For a ``TensorDataset`` already in
    memory, 0 workers usually wins, and the tuner says so.

    What the loader yields never changes: the returned loader reuses the original's dataset, sampler or
    batch sampler, ``collate_fn``, ``drop_last``, ``generator``, ``timeout``, ``worker_init_fn``,
    ``persistent_workers`` and multiprocessing context, and changes only ``num_workers``, ``pin_memory``
    and ``prefetch_factor``. The same seed gives the same batches in the same order, every epoch.
    ``persistent_workers`` is kept because it changes the order: persistent workers draw the epoch's worker
    seed from the loader's generator once, others draw it every epoch, which shifts a shuffle sharing that
    generator from the second epoch on. So a loader with persistent workers is not tuned down to 0 workers,
    and one without keeps restarting its workers each epoch (build it with :func:`fast_loader` to get
    persistent workers from the start).
    Timing reads consecutive indices (not your sampler), on a copy of the generator, and restores the
    global RNG states (torch, numpy, random) afterwards, so the run that follows draws the same numbers.
    A dataset whose ``__getitem__`` itself draws random numbers gets them from each worker's stream
    instead of the main process's, as with any change of ``num_workers``; state a dataset keeps in itself
    (its own ``numpy.random.Generator``, a cache) does advance during 0-worker trials.

    Under the ``spawn`` and ``forkserver`` start methods, the dataset, ``collate_fn`` and
    ``worker_init_fn`` are test-pickled first (into a sink that keeps no bytes; a large in-memory dataset
    costs about one worker start); if one cannot be pickled, only 0 workers is timed and one
    :class:`~speedups.SpeedupsWarning` names the object. An ``IterableDataset`` keeps its ``num_workers``
    (more workers would each replay the stream unless it shards itself), with one warning saying so;
    only ``pin_memory`` and ``prefetch_factor`` are tuned for it.

    Args:
        loader: the DataLoader to tune; it is not modified and can still be used.
        max_seconds: time budget in seconds (> 0), worker start-up included; one started trial may run a
            little over it.
        candidates: settings to time instead of the default grid, e.g.
            ``[{"num_workers": 0}, {"num_workers": 4, "prefetch_factor": 4, "pin_memory": True}]``.
        progress: show a tqdm bar when tuning takes more than a second (needs tqdm).

    Returns:
        ``(new_loader, report)``: a plain ``DataLoader`` and a :class:`LoaderReport` (``print`` it).

    Raises:
        TypeError: ``loader`` is not a plain DataLoader (a subclass, such as ``distributed()``'s, would lose
            its behaviour: tune first, then wrap), or an argument has the wrong type.
        ValueError: ``max_seconds`` <= 0, or a malformed candidate.

    Example:
        >>> loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        >>> tuned, report = tune_loader(loader, max_seconds=1, candidates=[{"num_workers": 0}])
        >>> [b.tolist() for b in tuned] == [b.tolist() for b in loader]
        True
        >>> report.chosen["num_workers"]
        0
    """
    if not isinstance(progress, bool):
        raise TypeError(f"tune_loader(progress={progress!r}): expected True or False.")
    explicit = _check_tune_args(loader, max_seconds, candidates)
    began = time.perf_counter()
    deadline = began + float(max_seconds)
    method = _start_method(loader.multiprocessing_context)
    cuda = torch.cuda.is_available()
    iterable = isinstance(loader.dataset, IterableDataset)
    notes: list[str] = []

    blocked = None
    if method in _PICKLING_START_METHODS:
        blocked = _unpicklable(_worker_payload(loader.dataset, loader.collate_fn, loader.worker_init_fn))
    if blocked is not None:
        name, obj, err = blocked
        warnings.warn(
            f"tune_loader({name}={_short_repr(obj)}): workers start with {method!r}, which pickles the "
            f"{name}, and it cannot be pickled ({type(err).__name__}: {err}); staying at 0 workers. "
            f"Define it at module level (no lambda, local function or local class) to let workers help.",
            SpeedupsWarning,
            stacklevel=2,
        )
        notes.append(f"the {name} cannot be pickled under {method!r}, so only 0 workers was possible")
    if iterable:
        warnings.warn(
            f"tune_loader(IterableDataset {type(loader.dataset).__name__}): num_workers is kept at "
            f"{loader.num_workers}, since each extra worker would replay the whole stream unless the "
            f"dataset shards itself with get_worker_info(); only pin_memory and prefetch_factor are tuned.",
            SpeedupsWarning,
            stacklevel=2,
        )
        notes.append("num_workers is not tuned for an IterableDataset")

    # Persistent workers draw the epoch's base seed from the generator only once; 0 workers (or
    # non-persistent ones) draw it every epoch. Switching between the two would shift a shuffle that shares
    # that generator from the second epoch on, so the loader's own choice is kept.
    persistent = bool(loader.persistent_workers and loader.num_workers > 0)
    if persistent and blocked is None and not iterable:
        notes.append(
            "0 workers was not timed: the loader's persistent workers draw their seed from the generator "
            "once, 0 workers would draw it every epoch and change the shuffle from the second epoch on"
        )

    def allowed(workers: int) -> bool:
        if blocked is not None and workers > 0:
            return False
        if persistent and blocked is None and workers == 0:
            return False
        return not (iterable and workers != loader.num_workers)

    def settings(workers: int, pin: bool | None, prefetch: int | None) -> tuple[int, bool, int | None]:
        pin = cuda if pin is None else pin
        if workers == 0:
            return (0, pin, None)
        return (workers, pin, prefetch or 2)

    if explicit is not None:
        plan = [settings(c["num_workers"], c["pin_memory"], c["prefetch_factor"]) for c in explicit]
        plan = [s for s in plan if allowed(s[0])]
        extra_phases = False
    else:
        grid = [loader.num_workers] if iterable else _default_grid(loader)
        plan = [settings(w, None, None) for w in grid if allowed(w)]
        extra_phases = True
    if not plan:  # every candidate was excluded: keep the loader's own worker count
        plan = [settings(0 if blocked is not None else loader.num_workers, None, None)]
    plan = list(dict.fromkeys(plan))  # drop duplicates, keep order

    # Timing reads consecutive indices (or a fixed list from a custom batch sampler) on a copy of the
    # generator, so neither the loader's sampler nor its generator moves.
    timing_generator = torch.Generator()
    if loader.generator is not None:
        timing_generator.set_state(loader.generator.get_state())
    report = LoaderReport(start_method=method)
    # Each setting is timed twice, round-robin, and keeps its better rate: on a busy machine a burst of
    # someone else's work slows one run, rarely both.
    rounds = 2 if len(plan) > 1 or extra_phases else 1
    runs = rounds * (len(plan) + ((any(w > 0 for w, _, _ in plan) + cuda) if extra_phases else 0))
    bar = _progress(runs, progress)
    measured: dict[tuple[int, bool, int | None], LoaderTrial] = {}
    with preserved_rng(loader.generator, *_sampler_generators(loader)):
        sampling = _timing_sampling(loader)
        queue = plan * rounds
        i = done = 0
        while i < len(queue):
            setting = queue[i]
            i += 1
            now = time.perf_counter()
            if now >= deadline and measured:
                missing = set(queue[i - 1 :]) - set(measured)
                if missing:
                    notes.append(f"the time budget ran out before {len(missing)} setting(s) could be timed")
                break
            share = max(0.2, (deadline - now) / max(1, runs - done))
            trial = _time_setting(loader, sampling, setting, share, timing_generator)
            done += 1
            measured[setting] = _better(measured.get(setting), trial)
            if bar is not None:
                bar.update(1)
            if extra_phases and i == len(queue):  # refine the fastest worker setting, once each
                extra_phases = False
                best = max(measured.values(), key=lambda t: t.batches_per_s)
                extra: list[tuple[int, bool, int | None]] = []
                if best.num_workers > 0 and best.prefetch_factor == 2:
                    extra.append((best.num_workers, best.pin_memory, 4))
                if cuda:
                    extra.append((best.num_workers, not best.pin_memory, best.prefetch_factor))
                queue += [e for e in extra if e not in measured] * rounds
        if bar is not None:
            bar.close()
    report.trials = list(measured.values())

    chosen, reason = _choose(report.trials)
    workers, pin, prefetch = chosen
    report.chosen = {
        "num_workers": workers,
        "pin_memory": pin,
        "prefetch_factor": prefetch,
        "persistent_workers": persistent and workers > 0,
    }
    report.reason = "; ".join([reason, *notes]) + "."
    report.seconds = time.perf_counter() - began
    tuned = _build(
        loader,
        _sampling_kwargs(loader),
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=prefetch,
        persistent_workers=persistent and workers > 0,
        generator=loader.generator,
    )
    return tuned, report


def _sampler_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """Generators held by the loader's sampler and batch sampler (a custom batch sampler is read once)."""
    found = []
    for obj in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and g is not loader.generator:
            found.append(g)
    return found


def _timing_sampling(loader: DataLoader[Any]) -> dict[str, Any]:
    """Sampling arguments for timing runs: long enough for any trial, never touching the loader's sampler
    state that matters (a custom batch sampler is read once, under preserved RNG states)."""
    count = 100_000  # an upper bound on batches per trial; trials stop on time long before
    if isinstance(loader.dataset, IterableDataset):
        return _sampling_kwargs(loader)
    if loader.batch_sampler is None or _uses_default_batch_sampler(loader):
        n = len(loader.dataset)  # type: ignore[arg-type]
        if n == 0:
            return _sampling_kwargs(loader)
        batches = _TimingBatches(n, loader.batch_size, count)
        if loader.batch_sampler is None:
            return {"batch_size": None, "sampler": batches}
        return {"batch_size": 1, "batch_sampler": batches}
    sample = []
    for batch in loader.batch_sampler:
        sample.append(batch)
        if len(sample) >= 256:
            break
    if not sample:
        return _sampling_kwargs(loader)
    return {"batch_size": 1, "batch_sampler": _Cycle(sample, count)}


def _time_setting(
    loader: DataLoader[Any],
    sampling: Mapping[str, Any],
    setting: tuple[int, bool, int | None],
    share: float,
    generator: torch.Generator,
) -> LoaderTrial:
    workers, pin, prefetch = setting
    start = time.perf_counter()
    timing = _build(
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
            next(it)
        stamps.append(time.perf_counter())
        while time.perf_counter() - start < share or len(stamps) < 4:
            next(it)
            stamps.append(time.perf_counter())
    except StopIteration:
        pass
    finally:
        del it  # shuts the workers down now
    end = time.perf_counter()
    # The rate over the later two thirds: the first batches after the warm-up may already be waiting in
    # the prefetch queue and would flatter settings with more batches in flight.
    first = (len(stamps) - 1) // 3
    batches = len(stamps) - 1 - first
    elapsed = stamps[-1] - stamps[first] if stamps else 0.0
    rate = batches / elapsed if batches > 0 and elapsed > 0 else 0.0
    return LoaderTrial(workers, pin, prefetch, rate, batches, end - start)


def _better(old: LoaderTrial | None, new: LoaderTrial) -> LoaderTrial:
    """Merge two runs of one setting: the better rate (and its batch count), the time of both."""
    if old is None:
        return new
    best = new if new.batches_per_s > old.batches_per_s else old
    return dataclasses.replace(best, seconds=old.seconds + new.seconds)


def _choose(trials: Sequence[LoaderTrial]) -> tuple[tuple[int, bool, int | None], str]:
    measured = [t for t in trials if t.batches > 0]
    if not measured:
        t = trials[0]
        return (t.num_workers, t.pin_memory, t.prefetch_factor), "nothing could be measured (too few batches)"
    best = max(measured, key=lambda t: t.batches_per_s)
    ties = [t for t in measured if t.batches_per_s >= (1 - _TIE) * best.batches_per_s]
    pick = min(ties, key=lambda t: (t.num_workers, t.prefetch_factor or 0, t.pin_memory))
    if len(measured) == 1:
        reason = "the only setting timed"
    elif pick is best:
        reason = f"fastest: {best.batches_per_s:.1f} batches/s"
    else:
        reason = (
            f"{pick.batches_per_s:.1f} batches/s is within {_TIE:.0%} of the fastest "
            f"({best.batches_per_s:.1f} with num_workers={best.num_workers}, "
            f"prefetch_factor={best.prefetch_factor}), with fewer workers"
        )
    return (pick.num_workers, pick.pin_memory, pick.prefetch_factor), reason

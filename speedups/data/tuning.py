"""Tip 2: ``num_workers``, ``pin_memory``, ``prefetch_factor`` and torch's compute threads chosen by
measurement, not by folklore.

``tune_loader(loader)`` times a few settings for a few batches each and returns a rebuilt loader with the
fastest one, plus a :class:`LoaderReport`; the batches it yields, and their order, never change. With the
training step (``step=``) it also splits this process's CPUs between the loader's workers and torch's
compute threads (``torch.set_num_threads``), which otherwise fight for the same cores.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from speedups._helpers import validate
from speedups._helpers.hardware import cpus_per_process
from speedups._helpers.rng import preserved_rng
from speedups._helpers.validate import short
from speedups.data.persistence import EXACT, has_per_epoch_state, reseeds_workers, unwrapped
from speedups.data.sample_keys import SampleKeys
from speedups.data.step_guard import refuse_accumulate_step, step_name, updates_refused
from speedups.data.timing import (
    TUNED,
    LoaderTrial,
    better,
    rebuild_loader,
    sampler_generators,
    sampling_kwargs,
    time_setting,
    timing_sampling,
)
from speedups.data.workers import check_worker_init_fn, start_method, unpicklable_for_workers
from speedups.device import default_device
from speedups.errors import SpeedupsWarning

__all__ = ["LoaderReport", "tune_loader"]

# A setting within this fraction of the fastest counts as a tie; ties go to fewer workers (less memory).
_TIE = 0.05

# The environment variables through which a user fixes torch's compute threads (read by torch at start).
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# (num_workers, pin_memory, prefetch_factor, num_threads): one timed setting; num_threads None keeps them.
Setting = tuple[int, bool, int | None, int | None]


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
        measured: what each rate is of: ``"loading alone"``, or ``"loading with the training step"``
            (``tune_loader(step=...)``: batches/s of the whole loop).
        num_threads_before: ``torch.get_num_threads()`` before the call; ``chosen["num_threads"]`` is the
            count after it. ``torch.set_num_threads(report.num_threads_before)`` undoes the choice.
    """

    trials: list[LoaderTrial] = field(default_factory=list)
    chosen: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    start_method: str = ""
    measured: str = "loading alone"
    num_threads_before: int | None = None

    def __str__(self) -> str:
        lines = [
            f"tune_loader: {len(self.trials)} setting(s) timed in {self.seconds:.1f} s "
            f"(start method {self.start_method!r}); measured: {self.measured}",
            f"{'num_workers':>11}  {'pin_memory':>10}  {'prefetch':>8}  {'threads':>7}  {'batches/s':>10}  "
            f"{'batches':>7}",
        ]
        for t in self.trials:
            keys = (*TUNED, "num_threads")
            mark = (
                "  <- chosen" if all(t.settings[k] == self.chosen.get(k) for k in keys) and t.batches else ""
            )
            prefetch = "-" if t.prefetch_factor is None else str(t.prefetch_factor)
            threads = "-" if t.num_threads is None else str(t.num_threads)
            lines.append(
                f"{t.num_workers:>11}  {t.pin_memory!s:>10}  {prefetch:>8}  {threads:>7}  "
                f"{t.batches_per_s:>10.1f}  {t.batches:>7}{mark}"
            )
        chosen = ", ".join(f"{k}={v!r}" for k, v in self.chosen.items())
        lines.append(f"chosen: {chosen}")
        lines.append(f"why: {self.reason}")
        return "\n".join(lines)


def _check_tune_args(
    loader: object,
    max_seconds: object,
    candidates: object,
    progress: object,
    step: object = None,
    num_threads: object = "auto",
) -> list[dict[str, Any]] | None:
    """Validate ``tune_loader``'s arguments; return the candidates as full dicts, or None for the grid."""
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"tune_loader(loader={short(loader)}): expected a torch.utils.data.DataLoader, got "
            f"{type(loader).__name__}. Pass the loader itself, e.g. tune_loader(DataLoader(ds, 64))."
        )
    if type(loader) is not DataLoader:
        raise TypeError(
            f"tune_loader(loader={type(loader).__name__}): a DataLoader subclass would be rebuilt as a plain "
            f"DataLoader and lose what the subclass adds (a DistributedLoader would stop advancing its "
            f"epoch). Tune the plain loader first, then wrap it: "
            f"loader = distributed(tune_loader(loader)[0])."
        )
    said = f"tune_loader(max_seconds={max_seconds!r}, candidates={candidates!r}"
    said += ")" if num_threads == "auto" else f", num_threads={num_threads!r})"
    with validate.arguments(said):
        validate.flag(progress, "progress")
        check_worker_init_fn(loader.worker_init_fn, "loader.worker_init_fn")  # any worker count may be timed
        if step is not None and not callable(step):
            raise TypeError(
                f"step={short(step)}: expected a function of one batch (the step's work without its update), "
                f"or None to time loading alone. Pass e.g. step=lambda batch: loss_fn(probe(batch[0]), "
                f"batch[1]).backward(), with probe = copy.deepcopy(model)."
            )
        validate.real(max_seconds, "max_seconds", positive=True, example="20 (seconds)")
        if num_threads != "auto":
            fix = "'auto' (timed with the step), an int >= 1, or None (left as they are)"
            validate.integer(num_threads, "num_threads", minimum=1, none_ok=True, example=fix)
        if candidates is None:
            return None
        example = "candidates=[{'num_workers': 0}, {'num_workers': 2, 'prefetch_factor': 4}]"
        if (
            isinstance(candidates, (str, bytes, Mapping))
            or not isinstance(candidates, Sequence)
            or not candidates
        ):
            raise TypeError(f"candidates must be a non-empty list of dicts, or None. Pass e.g. {example}.")
        out = []
        for cand in candidates:  # entries of a list: a malformed one is a ValueError whatever its type
            if not isinstance(cand, Mapping) or not set(cand) <= set(TUNED) or "num_workers" not in cand:
                raise ValueError(
                    f"each candidate is a dict with 'num_workers' and optionally 'pin_memory' and "
                    f"'prefetch_factor'; got {cand!r}. Pass e.g. {example}."
                )
            w, pin, pf = cand["num_workers"], cand.get("pin_memory"), cand.get("prefetch_factor")
            if isinstance(w, bool) or not isinstance(w, int) or w < 0:
                raise ValueError(f"num_workers must be an int >= 0, got {w!r}. Pass e.g. {example}.")
            if pin is not None and not isinstance(pin, bool):
                raise ValueError(f"pin_memory must be a bool, got {pin!r}. Pass e.g. {example}.")
            if pf is not None and (isinstance(pf, bool) or not isinstance(pf, int) or pf < 1 or w == 0):
                raise ValueError(
                    f"prefetch_factor must be an int >= 1 and only with num_workers > 0, got {cand!r}. "
                    f"Pass e.g. {example}."
                )
            out.append({"num_workers": w, "pin_memory": pin, "prefetch_factor": pf})
    return out


def _default_grid(loader: DataLoader[Any]) -> list[int]:
    most = max(1, cpus_per_process())  # measuring one worker is cheap even on a crowded node
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


@contextmanager
def _closing(bar: Any) -> Iterator[None]:
    """Close the progress bar (None: none) when the block ends, whatever ends it."""
    try:
        yield
    finally:
        if bar is not None:
            bar.close()


def tune_loader(
    loader: DataLoader[Any],
    *,
    max_seconds: float = 20.0,
    candidates: Sequence[Mapping[str, Any]] | None = None,
    progress: bool = True,
    step: Callable[[Any], object] | None = None,
    num_threads: int | str | None = "auto",
) -> tuple[DataLoader[Any], LoaderReport]:
    """Time a few loader settings on this machine and return a loader rebuilt with the fastest one.

    Each setting (``num_workers``, ``pin_memory``, ``prefetch_factor``) is timed twice, round-robin, on a
    share of ``max_seconds`` after a warm-up of ``num_workers * prefetch_factor`` batches, and keeps its
    better rate. The default grid is 0, 1, 2, 4, ... workers up to the CPUs this process may use (and the
    loader's own count), then ``prefetch_factor=4`` for the fastest, then ``pin_memory`` flipped with CUDA.
    With CUDA each batch is also copied to this process's GPU (:func:`~speedups.to_device`, as the loop
    does), so pinning is judged by what it saves on the copy. A setting within 5% of the fastest is a tie,
    won by fewer workers, then by the loader's own ``pin_memory``. Without ``step`` only loading is timed;
    with it each batch also goes through the training step here, so workers compete with the step for the
    cores, as in training. The step must not train, since it runs on thousands of batches: one that is or
    calls an ``@accumulate`` step is refused before anything runs, and an optimizer step inside it (any
    ``torch.optim.Optimizer``, seen by a global step pre-hook while tuning) is refused when it comes, before
    that optimizer changes anything. The LR schedulers, the optimizers' hyperparameters (``param_groups``)
    and the GradScalers alive when tuning starts are recorded (one ``gc`` scan) and compared after timed
    calls 1, 2, 4, 8, ... and at the end: a step that moved them (``scheduler.step()``, ``scaler.update()``)
    is refused once they are put back exactly. Give it the step's work without the update, on a copy of the
    model.

    Compute threads (``num_threads="auto"`` with a ``step``): the CPUs this process may use are split
    between loading and compute. First the step runs at the plan's fewest workers ``w`` with
    ``min(torch.get_num_threads(), CPUs - w)`` threads, half as many and 1 (threads waiting on a core that
    another process holds make a CPU step several times slower), and the fewest within 5% of the fastest
    win; then each worker setting runs with at most that many and the CPUs its workers leave. The winner (a
    tie goes to fewer workers, then fewer threads) is set with ``torch.set_num_threads``. The thread count
    changes float rounding, so runs tuned on a busy and a quiet machine may differ in the last bits: threads
    are kept as they are under ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` and deterministic algorithms; an int
    fixes them, None leaves them alone.

    What the loader yields never changes: the new loader reuses the dataset, sampler, ``collate_fn``,
    ``drop_last``, ``generator``, ``timeout``, ``worker_init_fn`` and context. Its workers persist and draw
    what fresh ones draw (one base seed per epoch, as 0 workers do: ``fast_loader``'s), so the shuffle is the
    same for any worker count; torch's own persistent workers (``persistent_workers=True`` on the loader),
    which draw it once, are kept, and such a loader is never tuned down to 0 workers (the shuffle would
    shift from epoch 2 on). Random augmentation in ``__getitem__`` stays the same across worker counts only
    with ``fast_loader(..., sample_seeds=True)`` (whose own order is free of all that).
    Timing reads its own indices on a copy of the generator and restores the global RNG states (state a
    dataset keeps in itself, such as its own ``numpy.random.Generator``, does advance). Unpicklable code
    under ``spawn``/``forkserver`` keeps 0 workers, and an ``IterableDataset`` its worker count, each with
    one :class:`~speedups.SpeedupsWarning`.

    Args:
        loader: the plain DataLoader to tune; it is not modified and can still be used.
        max_seconds: time budget in seconds (> 0), worker start-up included; one started trial may overrun.
        candidates: settings to time instead of the grid, e.g.
            ``[{"num_workers": 0}, {"num_workers": 4, "prefetch_factor": 4, "pin_memory": True}]``.
        progress: show a tqdm bar when tuning takes more than a second (needs tqdm).
        step: the training step's work without its update (forward and backward on a copy of the model),
            called as ``step(batch)`` on every timed batch (after the copy to the GPU with CUDA); None times
            loading alone.
        num_threads: torch's compute threads in this process: ``"auto"`` (timed with ``step``; without one,
            left alone), an int >= 1 (used for every trial, and set), or None (left alone).

    Returns:
        ``(new_loader, report)``: a plain ``DataLoader`` and a :class:`LoaderReport` (``print`` it);
        ``report.chosen["num_threads"]`` is the thread count in force after the call, and
        ``torch.set_num_threads(report.num_threads_before)`` puts back the one before.

    Raises:
        TypeError: ``loader`` is not a plain DataLoader (a subclass such as ``distributed()``'s would lose
            its behaviour: tune first, then wrap), or an argument has the wrong type.
        ValueError: ``max_seconds`` not > 0 and finite, ``num_threads`` < 1, or a malformed candidate.
        SpeedupsError: ``step`` is, wraps or calls by name an ``@accumulate`` step (nothing has run), it
            stepped an optimizer (refused before that optimizer changed anything; the gradients its backward
            left stay), or it moved an LR scheduler, an optimizer's hyperparameters or a GradScaler (put
            back exactly first).

    Example:
        >>> loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        >>> tuned, report = tune_loader(loader, max_seconds=1, candidates=[{"num_workers": 0}])
        >>> [b.tolist() for b in tuned] == [b.tolist() for b in loader]
        True
        >>> report.chosen["num_workers"]
        0
    """
    explicit = _check_tune_args(loader, max_seconds, candidates, progress, step, num_threads)
    said = f"tune_loader(step={step_name(step)})"
    refuse_accumulate_step(step, said)  # before anything runs
    began = time.perf_counter()
    deadline = began + float(max_seconds)
    method = start_method(loader.multiprocessing_context)
    copy_to = _copy_target()
    cuda = copy_to is not None
    iterable = isinstance(loader.dataset, IterableDataset)
    notes: list[str] = []

    dataset = unwrapped(loader.dataset)  # the user's
    blocked = unpicklable_for_workers(method, dataset, loader.collate_fn, loader.worker_init_fn)
    if blocked is not None:
        name, obj, err = blocked
        warnings.warn(
            f"tune_loader({name}={short(obj)}): workers start with {method!r}, which pickles the "
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

    # torch's persistent workers draw the epoch's base seed from the generator only once; 0 workers,
    # non-persistent ones and those that persist exactly (build_loader) draw it every epoch. Switching
    # between the two would shift a shuffle that shares that generator from the second epoch on, so torch's
    # persistence, where the loader has it, is kept.
    persistent = bool(loader.persistent_workers and loader.num_workers > 0) and not reseeds_workers(loader)
    keyed = _keyed_order(loader)
    if keyed:  # fast_loader(..., sample_seeds=True): the order and the samples never read the generator
        persistent = persistent or (loader.num_workers == 0 and not has_per_epoch_state(dataset))
    if persistent and blocked is None and not iterable and not keyed:
        notes.append(
            "0 workers was not timed: the loader's persistent workers draw their seed from the generator "
            "once, 0 workers would draw it every epoch and change the shuffle from the second epoch on"
        )

    threads_before = torch.get_num_threads()
    threads_for, tune_threads, thread_note = _thread_plan(num_threads, step, threads_before)
    if thread_note:
        notes.append(thread_note)

    def allowed(workers: int) -> bool:
        if blocked is not None and workers > 0:
            return False
        if persistent and blocked is None and workers == 0 and not keyed:
            return False
        return not (iterable and workers != loader.num_workers)

    def settings(workers: int, pin: bool | None, prefetch: int | None) -> Setting:
        pin = cuda if pin is None else pin
        if workers == 0:
            return (0, pin, None, threads_for(workers))
        return (workers, pin, prefetch or 2, threads_for(workers))

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
    measured_what = "loading alone" if step is None else "loading with the training step"
    report = LoaderReport(start_method=method, measured=measured_what)
    # Each setting is timed twice, round-robin, and keeps its better rate: on a busy machine a burst of
    # someone else's work slows one run, rarely both.
    rounds = 2 if len(plan) > 1 or extra_phases or tune_threads else 1
    # Compute threads first (tune_threads): the step at the plan's fewest workers with all the threads the
    # split leaves, half as many and 1; the plan then runs with no more threads than the fastest of those.
    first = min(plan, key=lambda s: s[0])
    threads_stage = [(*first[:3], t) for t in sorted({first[3] or 1, (first[3] or 1) // 2, 1} - {0})[::-1]]
    loader_phases = (any(s[0] > 0 for s in plan) + cuda) if extra_phases else 0
    runs = rounds * (len(plan) + loader_phases + (len(threads_stage) if tune_threads else 0))
    bar = _progress(runs, progress)
    measured: dict[Setting, LoaderTrial] = {}
    with (
        preserved_rng(loader.generator, *sampler_generators(loader)),
        updates_refused(step, said) as timed_step,  # an optimizer step inside the step: refused
        _closing(bar),
    ):
        sampling = timing_sampling(loader)
        queue = threads_stage * rounds if tune_threads else plan * rounds
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
            workers, pin, prefetch, threads = setting
            trial = time_setting(
                loader,
                sampling,
                (workers, pin, prefetch),
                share,
                timing_generator,
                device=copy_to,
                step=timed_step,
                num_threads=threads,
            )
            done += 1
            measured[setting] = better(measured.get(setting), trial)
            if bar is not None:
                bar.update(1)
            if i < len(queue):
                continue
            w, pin, prefetch, threads = max(measured, key=lambda key: measured[key].batches_per_s)
            extra: list[Setting] = []
            if tune_threads:  # the threads are chosen: the plan, with at most that many
                tune_threads = False
                most_threads = _fewest_threads(measured)
                capped = [(*p[:3], min(most_threads, p[3] or 1)) for p in plan]
                extra = [p for p in dict.fromkeys(capped) if p not in measured]
            if not extra and extra_phases:  # refine the fastest worker setting, once each
                extra_phases = False
                if w > 0 and prefetch == 2:
                    extra.append((w, pin, 4, threads))
                if cuda:
                    extra.append((w, not pin, prefetch, threads))
                extra = [e for e in extra if e not in measured]
            queue += extra * rounds
    report.trials = list(measured.values())

    chosen, reason = _choose(report.trials, keep_pin=bool(loader.pin_memory))
    workers, pin, prefetch, threads = chosen
    if threads_for(workers) is not None and threads is not None:  # tuned or given: set for the training
        torch.set_num_threads(threads)
        if num_threads == "auto":
            notes.append(
                f"compute threads: {threads} (torch.set_num_threads({threads}); it was {threads_before})"
            )
    tuned = rebuild_loader(
        loader,
        sampling_kwargs(loader),
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=prefetch,
        persistent_workers=(True if persistent else EXACT) if workers > 0 else False,
        generator=loader.generator,
    )
    report.num_threads_before = threads_before
    report.chosen = {
        "num_workers": workers,
        "pin_memory": pin,
        "prefetch_factor": prefetch,
        "persistent_workers": bool(tuned.persistent_workers),
        "num_threads": torch.get_num_threads(),
    }
    report.reason = "; ".join([reason, *notes]) + "."
    report.seconds = time.perf_counter() - began
    return tuned, report


def _keyed_order(loader: DataLoader[Any]) -> bool:
    """Whether the order and the samples depend on (seed, epoch) alone (``fast_loader(...,
    sample_seeds=True)`` without a sampler of the user's). Then persistent workers and 0 workers yield the
    same batches, so both may be timed, and workers chosen for a 0-worker loader persist, as in fast_loader.
    """
    sampler = unwrapped(loader.sampler)
    return isinstance(sampler, SampleKeys) and sampler.is_seeded_order


def _copy_target() -> torch.device | None:
    """The GPU batches go to in the training loop (timed with each setting), None without CUDA."""
    return default_device() if torch.cuda.is_available() else None


def _choose(
    trials: Sequence[LoaderTrial], keep_pin: bool = False
) -> tuple[tuple[int, bool, int | None, int | None], str]:
    measured = [t for t in trials if t.batches > 0]
    if not measured:
        t = trials[0]
        chosen = (t.num_workers, t.pin_memory, t.prefetch_factor, t.num_threads)
        return chosen, "nothing could be measured (too few batches)"
    best = max(measured, key=lambda t: t.batches_per_s)
    ties = [t for t in measured if t.batches_per_s >= (1 - _TIE) * best.batches_per_s]
    # ties: fewer workers, then fewer compute threads, then less prefetch, then the loader's own pinning (a
    # tie means flipping it did not measurably help)
    pick = min(
        ties,
        key=lambda t: (t.num_workers, t.num_threads or 0, t.prefetch_factor or 0, t.pin_memory != keep_pin),
    )
    if len(measured) == 1:
        reason = "the only setting timed"
    elif pick is best:
        reason = f"fastest: {best.batches_per_s:.1f} batches/s"
    else:
        reason = (
            f"{pick.batches_per_s:.1f} batches/s is within {_TIE:.0%} of the fastest "
            f"({best.batches_per_s:.1f} with num_workers={best.num_workers}, "
            f"prefetch_factor={best.prefetch_factor}, {best.num_threads} threads), with fewer workers or "
            f"threads"
        )
    return (pick.num_workers, pick.pin_memory, pick.prefetch_factor, pick.num_threads), reason


def _fewest_threads(measured: Mapping[Setting, LoaderTrial]) -> int:
    """The threads stage's choice: the fewest threads whose rate is within 5% of the best. The rate is the
    mean over many batches, not a median: threads next to a busy core lose their time in stalls now and
    then, which a median would not see."""
    best = max(t.batches_per_s for t in measured.values())
    return min((key[3] or 1) for key, t in measured.items() if t.batches_per_s >= (1 - _TIE) * best)


def split_cores(cores: int, workers: int, threads_now: int) -> int:
    """Compute threads beside ``workers`` loader processes on ``cores`` CPUs: the cores the workers leave,
    never more than ``threads_now`` (torch's count, or the user's), at least 1."""
    return max(1, min(threads_now, cores - workers))


def _thread_plan(
    num_threads: int | str | None, step: object, threads_now: int
) -> tuple[Callable[[int], int | None], bool, str]:
    """How trials set compute threads: ``(threads for w workers, whether fewer are tried, a note)``.

    A function returning None keeps the count in force (and the call leaves it).
    """
    if num_threads is None:
        return (lambda workers: None), False, ""
    if isinstance(num_threads, int):
        fixed = num_threads
        return (lambda workers: fixed), False, f"compute threads: {fixed} (num_threads={fixed})"
    if step is None:  # loading alone: the step's threads are not in the measure
        return (lambda workers: None), False, ""
    kept = f"compute threads kept at {threads_now}"
    variables = [name for name in _THREAD_VARIABLES if os.environ.get(name)]
    if variables:
        return (lambda workers: None), False, f"{kept}: {variables[0]} is set"
    if torch.are_deterministic_algorithms_enabled():
        why = "deterministic algorithms are on, and the thread count changes float rounding"
        return (lambda workers: None), False, f"{kept}: {why}"
    cores = max(1, cpus_per_process())
    return (lambda workers: split_cores(cores, workers, threads_now)), True, ""

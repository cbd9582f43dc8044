"""What DataLoader worker processes need: their start method, a pickling check, and shelter from the signals
that stop a run (their random streams stay as torch seeds them, as in a plain ``DataLoader``).

A preempted job gets SIGTERM (or SIGUSR1) in every process, loader workers included (torchrun signals each
worker's whole process group; SLURM every process of the step). A worker that dies of it makes the main
process raise "DataLoader worker is killed by signal" before it can save. Workers of ``fast_loader`` and
``distributed()`` ignore those signals (:func:`shelter_worker`): the main process decides when to stop, and
its workers end with it (torch's workers exit when their parent is gone, within 5 s). At interpreter exit,
``multiprocessing`` would end workers still alive (a persistent loader held by a module-level name) with
SIGTERM and wait for them: this process first ends the ones that ignore it with SIGKILL
(:func:`release_workers_at_exit`), so that wait never hangs.

Shared by :func:`~speedups.fast_loader` and :func:`~speedups.tune_loader`. Under the ``spawn`` and
``forkserver`` start methods (the default on macOS, Windows and Python 3.14) what a worker needs is
test-pickled before any worker starts, so a lambda ``collate_fn`` fails early with a message that names it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import inspect
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable

from torch.utils.data import DataLoader

from speedups._helpers.validate import short

__all__ = [
    "PICKLING_START_METHODS",
    "STOP_SIGNALS",
    "check_worker_init_fn",
    "dataloader_parameters",
    "release_workers_at_exit",
    "seed_worker",
    "shelter_worker",
    "sheltered",
    "start_method",
    "unpicklable_for_workers",
]

# Start methods that send the dataset, collate_fn and worker_init_fn to each worker by pickling them.
PICKLING_START_METHODS = ("spawn", "forkserver")

STOP_SIGNALS: set[int] = {int(signal.SIGTERM), int(getattr(signal, "SIGUSR1", signal.SIGTERM))}
"""The signals loader workers ignore: SIGTERM and SIGUSR1, and those a :class:`~speedups.StopOnSignal` of this
process watches (it adds them; workers started by ``fork`` see its additions, ``spawn`` workers the two)."""


def _ignore_stop_signals() -> None:
    for number in STOP_SIGNALS:
        with contextlib.suppress(OSError, ValueError):  # not a signal of this platform
            signal.signal(number, signal.SIG_IGN)


def shelter_worker(worker_id: int, init_fn: Callable[[int], object] | None = None) -> None:
    """A loader worker's ``worker_init_fn``: ignore :data:`STOP_SIGNALS`, then call ``init_fn``."""
    _ignore_stop_signals()
    if init_fn is not None:
        init_fn(worker_id)


def check_worker_init_fn(init_fn: object, name: str = "worker_init_fn") -> None:
    """Refuse a ``worker_init_fn`` no worker can call: not callable, or not as ``init_fn(worker_id)``.

    Checked with ``inspect.signature(init_fn).bind(0)`` before any worker starts (torch calls it only inside
    a worker, at the first batch); a callable whose signature cannot be read (some builtins, extension
    objects) passes. The message starts with ``name=...``, for the caller's ``validate.arguments`` to prefix.

    Raises:
        TypeError: ``init_fn`` is neither None nor callable, or cannot take one positional argument.
    """
    if init_fn is None:
        return
    if not callable(init_fn):
        raise TypeError(
            f"{name}={short(init_fn)}: expected a function of the worker id, or None, got "
            f"{type(init_fn).__name__}. Write worker_init_fn=None, or def init(worker_id): ... and "
            f"worker_init_fn=init."
        )
    try:
        signature = inspect.signature(init_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, an extension object): trust it
        return
    try:
        signature.bind(0)
    except TypeError as err:
        bare = signature.replace(  # as written, without annotations: (worker_id, other)
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        called = getattr(init_fn, "__name__", "")
        called = called if called.isidentifier() else "init"
        raise TypeError(
            f"{name}={short(init_fn)}: each loader worker calls it with one positional argument, its worker "
            f"id, and its signature {bare} cannot take that ({err}). Give it one parameter, def "
            f"{called}(worker_id): ..., or bind the others: worker_init_fn=functools.partial({called}, ...)."
        ) from None


def sheltered(init_fn: Callable[[int], object] | None) -> Callable[[int], object]:
    """``init_fn`` made to shelter its worker from the stop signals (it already does if it is ours)."""
    release_workers_at_exit()
    inner = init_fn.func if isinstance(init_fn, functools.partial) else init_fn
    if inner in (seed_worker, shelter_worker):
        return init_fn  # type: ignore[return-value]
    return functools.partial(shelter_worker, init_fn=init_fn)


_release_registered = False


def release_workers_at_exit() -> None:
    """Register, once per process, the exit handler that ends sheltered workers (see the module docstring).

    Registered after ``multiprocessing``'s own exit handler, so it runs before it.
    """
    global _release_registered
    if not _release_registered:
        _release_registered = True
        # multiprocessing.util registers its exit handler when first imported (else at the first worker's
        # start): imported now, it is registered before ours, which therefore runs first.
        importlib.import_module("multiprocessing.util")
        atexit.register(_release_sheltered_workers)


def _ignores_sigterm(pid: int) -> bool | None:
    """Whether process ``pid`` ignores SIGTERM (Linux: its ``SigIgn`` mask), or None when unknown."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (int(signal.SIGTERM) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _release_sheltered_workers() -> None:
    """End this process's daemonic children that ignore SIGTERM (SIGKILL), before ``multiprocessing``
    terminates them with SIGTERM and waits for them. One that does not (yet) ignore it, or whose signal mask
    cannot be read, gets SIGTERM, half a second to go, then SIGKILL."""
    children = [c for c in multiprocessing.active_children() if c.daemon and c.pid not in (None, os.getpid())]
    if not children:
        return
    if threading.current_thread() is threading.main_thread():
        # torch's loader watches its workers through SIGCHLD and raises when one dies: at exit, ending them
        # is what is meant.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        try:
            if not _ignores_sigterm(child.pid):  # type: ignore[arg-type]  # (or unknown, or not yet: a worker
                child.terminate()  # still starting may ignore it by the time it arrives)
                child.join(0.5)
            if child.is_alive():
                child.kill()
                child.join(5.0)
        except Exception:  # an exit handler: the others must still be ended
            continue


def seed_worker(worker_id: int, init_fn: Callable[[int], object] | None = None) -> None:
    """A DataLoader worker's ``worker_init_fn``: ignore :data:`STOP_SIGNALS`, then call ``init_fn``.

    The worker's random streams are left exactly as torch seeded them, so its draws are a plain
    ``DataLoader``'s: torch seeds the worker's torch generator and ``random`` with ``base_seed + worker_id``
    and numpy's global ``RandomState`` from ``(base_seed, worker_id)``, where ``base_seed`` is drawn from the
    loader's ``generator`` (or the global torch RNG) each time an epoch's workers start (or, for workers that
    persist exactly, each epoch: :mod:`speedups.data.persistence` reseeds them). Every worker and
    epoch thus draws its own numbers, reproducibly from the generator's seed; reseeding any of them here
    would make a port's augmentation differ from its original's. Module-level (not a closure) so it pickles
    under ``spawn``. The worker ignores the stop signals, so a preempted main
    process can still save.
    """
    _ignore_stop_signals()
    if init_fn is not None:
        init_fn(worker_id)


def start_method(context: object) -> str:
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


def unpicklable_for_workers(
    method: str, dataset: object, collate_fn: object, worker_init_fn: object
) -> tuple[str, object, Exception] | None:
    """What workers started with ``method`` would fail to unpickle: ``(name, object, error)``, or None.

    Only ``spawn`` and ``forkserver`` pickle the dataset, ``collate_fn`` and ``worker_init_fn``; under
    ``fork`` this returns None without pickling anything. The bytes go to a sink that keeps none, so a large
    in-memory dataset costs about one worker start.
    """
    if method not in PICKLING_START_METHODS:
        return None
    for name, obj in (("dataset", dataset), ("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if obj is None:
            continue
        try:
            pickle.Pickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as err:
            return name, obj, err
    return None


@functools.cache
def dataloader_parameters() -> frozenset[str]:
    """The argument names this torch's ``DataLoader`` takes."""
    return frozenset(inspect.signature(DataLoader.__init__).parameters)

"""Tip 9 without torchrun: :func:`launch` starts N processes from a script or a notebook.

It runs on ``torch.distributed.elastic``, the agent inside torchrun (``elastic_launch``): the same
rendezvous, environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), restarts and
failure handling as ``torchrun --nproc-per-node N``, so every other tip sees a torchrun job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.environments import detect
from speedups._helpers.notes import add_note
from speedups.errors import SpeedupsError
from speedups.parallel.process_group import destroy_distributed, init_distributed

__all__ = ["launch"]

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # the ones the elastic agent takes over


class _ChildTraceback(Exception):
    """The traceback of the exception raised in a child process, as text (shown as the cause)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


def launch(
    fn: Callable[..., Any], *args: Any, nprocs: int, max_restarts: int = 0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` processes on this machine; return the results in rank order.

    The processes are started by ``torch.distributed.elastic`` (torchrun's agent) on 127.0.0.1: each
    gets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` as under torchrun, the process group is initialised before
    ``fn`` runs (:func:`~speedups.init_distributed`: gloo on the CPU, nccl with CUDA, ``cuda:LOCAL_RANK``)
    and destroyed after it returns, so ``ddp_wrap``, ``distributed`` and ``gather`` work inside unchanged.
    A function a fresh interpreter can import (a module, or a script's ``__main__`` under
    ``if __name__ == "__main__":``) is started with ``spawn``; one that cannot be imported (defined in a
    notebook cell, in ``python -c``, a lambda or closure) with ``fork``, which is refused once CUDA is
    initialised in this process. If a process raises, the others are stopped and the exception is re-raised
    here, its cause holding the child's traceback. As under torchrun, with ``nprocs > 1`` and no
    ``OMP_NUM_THREADS`` set, each process gets ``OMP_NUM_THREADS=1`` (one CPU thread for torch): N
    processes with a thread per core each would oversubscribe the CPUs. Set it before calling to choose.

    Args:
        fn: the function each process runs (its return value must be picklable).
        *args: positional arguments of ``fn`` (picklable with ``spawn``).
        nprocs: the number of processes (for GPUs: at most one per GPU).
        max_restarts: how many times the whole group is restarted after a failure (as torchrun's
            ``--max-restarts``); resume from a checkpoint inside ``fn``.
        **kwargs: keyword arguments of ``fn``.

    Returns:
        ``[fn's result on rank 0, ..., on rank nprocs - 1]``.

    Raises:
        TypeError, ValueError: bad ``fn``, ``nprocs`` or ``max_restarts``.
        SpeedupsError: called inside a job that already has several processes; ``fork`` needed but CUDA is
            initialised here; a process died without a Python exception (signal, ``os._exit``).
        Exception: the first exception raised in a process, with that process's traceback as its cause.

    Example:
        >>> def square(x):  # a notebook cell defines the function, then:
        ...     return x * x
        >>> launch(square, 3, nprocs=2)  # doctest: +SKIP
        [9, 9]
    """
    name = getattr(fn, "__qualname__", type(fn).__name__)
    said = f"launch({name}, nprocs={nprocs!r}, max_restarts={max_restarts!r})"
    with validate.arguments(said):
        if not callable(fn):
            raise TypeError(f"fn={fn!r} is not callable. Pass the function itself: launch(train, nprocs=2).")
        validate.integer(nprocs, "nprocs", minimum=1, example="2")
        validate.integer(max_restarts, "max_restarts", minimum=0, example="0")
    started_by = detect()
    if started_by.launched and env.world_size() > 1:
        raise SpeedupsError(
            f"{said}: this process is already one of {env.world_size()} processes ({started_by.name}): "
            f"launching more from each would multiply them. Call fn directly here, or run the script with "
            f"plain `python`."
        )
    method = "spawn" if _importable(fn) else "fork"
    if method == "fork":
        if not hasattr(os, "fork"):
            raise SpeedupsError(
                f"{said}: {name} cannot be imported by a new process and this platform cannot "
                f"fork. Move it into a .py file and import it: `from mytrain import train; "
                f"launch(train, nprocs=2)`."
            )
        if torch.cuda.is_initialized():
            raise SpeedupsError(
                f"{said}: {name} is defined where a new process cannot import it (a notebook "
                f"cell, python -c, a lambda), so the processes must be forked, and CUDA is already "
                f"initialised in this process, which a forked child cannot use. Restart the kernel and call "
                f"launch() before any CUDA work in the notebook (no .cuda(), torch.cuda.* calls), or "
                f"move {name} into a .py file and import it (then spawn is used)."
            )
    return _run(fn, args, kwargs, nprocs=nprocs, max_restarts=max_restarts, method=method, said=said)


def _importable(fn: Callable[..., Any]) -> bool:
    """True when a fresh interpreter can find ``fn`` by reference (``spawn`` can pickle it)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname:  # <lambda>, <locals>
        return False
    if module == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)  # "<stdin>" under `python - < file`: no file to re-run
        if path is None or not os.path.isfile(path) or hasattr(sys, "ps1"):  # python -c, REPL, notebook
            return False
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


def _run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    nprocs: int,
    max_restarts: int,
    method: str,
    said: str,
) -> list[Any]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="speedups-launch-") as tmp, _restored_process_state(nprocs):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=f"speedups-{uuid.uuid4().hex}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=method,
            local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp) / "logs")),
        )
        try:
            results = elastic_launch(config, _child)(fn, args, kwargs, tmp)
        except ChildFailedError as err:
            rank, failure = err.get_first_failure()
            reported = _reported(Path(tmp), rank)
            if reported is None:
                raise SpeedupsError(
                    f"{said}: process rank {rank} died without a Python exception (exit code "
                    f"{failure.exitcode}{_signal_name(failure.exitcode)}); its output is above. Killed for "
                    f"memory, a crash in native code, or os._exit() are the usual causes."
                ) from err
            exc, text = reported
            add_note(
                exc,
                f"(raised in process rank {rank} of {said}; its traceback is the cause above)"
            )
            exc.__cause__ = _ChildTraceback(text)
            raise exc from exc.__cause__  # the child's traceback is the cause, not ChildFailedError
    return [results[i] for i in range(nprocs)]


def _child(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], report_dir: str) -> Any:
    """Entry point of each process: process group, ``fn``, report a failure for the parent, clean end."""
    try:
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # a forked child keeps the parent's thread pool otherwise
            torch.set_num_threads(int(threads))
        init_distributed()
        result = fn(*args, **kwargs)
        _check_picklable(result, fn)
    except BaseException as exc:
        rank, attempt = os.environ.get("RANK", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            payload = pickle.dumps((exc, text))
        except Exception:  # an exception that cannot be pickled: its type and text still reach the parent
            payload = pickle.dumps((SpeedupsError(f"{type(exc).__qualname__}: {exc}"), text))
        (Path(report_dir) / f"rank{rank}.attempt{int(attempt):04d}.pkl").write_bytes(payload)
        raise
    destroy_distributed()
    return result


def _check_picklable(result: Any, fn: Callable[..., Any]) -> None:
    """Raise here, where the cause can be named, if ``result`` cannot travel back to the parent."""
    try:
        pickle.dumps(result)
    except Exception as err:
        name = getattr(fn, "__name__", "fn")
        raise TypeError(
            f"launch({name}): {name} returned {validate.short(result)}, which cannot be pickled to reach "
            f"the parent process ({type(err).__name__}: {err}). Return plain data: numbers, strings, CPU "
            f"tensors, dicts and lists of them (e.g. `return {{k: v.cpu() for k, v in "
            f"model.state_dict().items()}}`), or save what you need to a file and return its path."
        ) from err


def _reported(report_dir: Path, rank: int) -> tuple[BaseException, str] | None:
    files = sorted(report_dir.glob(f"rank{rank}.attempt*.pkl"))
    if not files:
        return None
    exc, text = pickle.loads(files[-1].read_bytes())  # the last attempt
    return exc, text


def _signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    try:
        return f", {signal.Signals(-exitcode).name}"
    except ValueError:
        return ""


@contextlib.contextmanager
def _restored_process_state(nprocs: int) -> Iterator[None]:
    """Give back what the elastic agent (and the children's ``OMP_NUM_THREADS``) change in this process."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {}
    if main:
        for name in _SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:
                handlers[number] = signal.getsignal(number)
    saved = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None and nprocs > 1:  # as torchrun: N processes of all-cores thread pools oversubscribe
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        for number, handler in handlers.items():
            if handler is not None:
                signal.signal(number, handler)
        if saved is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = saved

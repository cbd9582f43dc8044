"""Background checkpoint writes: the loop waits for a copy of the state in host memory, a thread writes it.

``save_checkpoint(..., background=True)`` hands its payload here on rank 0 after copying every tensor in it
(a CPU model's ``state_dict()`` shares its parameters' memory, so the next optimizer step would change what
is being written). One write runs at a time, in a non-daemon thread (the interpreter waits for it at exit):
the next save, and any load, waits for the one before. The write itself is the atomic one of
:func:`~speedups.checkpoint.file_format.write`, so the previous checkpoint stays intact until the new one is
complete. A write that failed is said on stderr at once and raised by the next ``save_checkpoint`` (on every
rank), ``RunDirectory.close`` or ``StopOnSignal.exit``.

An FSDP2 checkpoint directory is written by ``torch.distributed.checkpoint.async_save`` instead, in DCP's own
thread (:mod:`speedups.checkpoint.sharded`); :func:`track` makes it the write in flight, which :func:`wait`
waits for, with what completes it (the rename into place).

This is the process's one writer: the module holds it, as the process holds its files.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from speedups._helpers.tree import tree_map
from speedups.checkpoint import file_format

__all__ = ["host_copy", "start", "take_error", "track", "wait"]

_lock = threading.Lock()
_thread: threading.Thread | None = None
_tracked: threading.Event | None = None  # set once DCP's save in flight and its completion have run
_error = ""  # the last failed write's message, until someone is told
_buffers: list[torch.Tensor] = []  # the host copy of the last payload, reused by the next one


def host_copy(payload: Any) -> Any:
    """``payload`` with every tensor copied to (pinned, for CUDA tensors) host memory; waits for the copies.

    The copies go into the buffers of the previous call where shapes and dtypes match (call it only when no
    write still reads them: after :func:`wait`), so a run that saves the same state again pays a copy, not
    an allocation (fresh memory costs a page fault per 4 KiB, about as much again as the copy). The process
    keeps that one host copy of the state between saves. A tensor no dense buffer can hold (sparse,
    quantized, a subclass) gets a copy of its own, as a foreground save would write it.

    Sync points: one device synchronisation when the payload holds device tensors.
    """
    global _buffers
    old, new, devices = iter(_buffers), [], set()

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if value.layout != torch.strided or value.is_quantized or type(value) is not torch.Tensor:
            # sparse (a sparse embedding's pending gradient), quantized, a subclass: no dense buffer holds
            # it (copy_ into one raises or densifies); a copy of its own, as a foreground save writes it
            if value.device.type != "cpu":
                devices.add(value.device)
            return value.to("cpu", copy=True)
        pinned = value.device.type == "cuda"
        host = next(old, None)
        if (
            host is None
            or host.shape != value.shape
            or host.dtype != value.dtype
            or host.is_pinned() != pinned
        ):
            host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pinned)
        if value.device.type != "cpu":
            devices.add(value.device)
        new.append(host)
        return host.copy_(value, non_blocking=pinned)

    copied = tree_map(copy, payload)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    _buffers = new
    return copied


def start(path: Path, payload: dict[str, Any], then: Callable[[], None] | None = None) -> None:
    """Write ``payload`` to ``path`` in a thread, after the write before (call :func:`take_error` first).

    ``payload`` must be this module's :func:`host_copy`, made after :func:`wait` (so its buffers are free).
    ``then`` runs in the thread after a successful write (a run directory drops its oldest checkpoints).
    """
    global _thread
    wait()
    thread = threading.Thread(
        target=_write, args=(path, payload, then), name=f"speedups checkpoint writer ({path.name})"
    )
    with _lock:
        _thread = thread
    thread.start()


def track(future: Future[Any], complete: Callable[[], None], path: Path) -> None:
    """Make ``future`` (``torch.distributed.checkpoint.async_save``'s) the write in flight: once it is done,
    ``complete()`` runs (in the thread that finished it; in this one if it is done already), and
    :func:`wait` returns only after both. Its error, or ``complete``'s, is kept as a failed write's."""
    global _tracked
    wait()
    done = threading.Event()

    def finished(result: Future[Any]) -> None:
        try:
            error = result.exception()
            if error is not None:
                raise error
            complete()
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
            _failed(err, path)
        finally:
            done.set()

    with _lock:
        _tracked = done
    future.add_done_callback(finished)


def wait() -> None:
    """Wait for the write in progress, if any (at once when there is none)."""
    with _lock:
        thread, tracked = _thread, _tracked
    if thread is not None:
        thread.join()
    if tracked is not None:
        tracked.wait()


def take_error() -> str:
    """The error of the last failed write, once ("" when none failed since the last call)."""
    global _error
    with _lock:
        error, _error = _error, ""
    return error


def _write(path: Path, payload: dict[str, Any], then: Callable[[], None] | None) -> None:
    try:
        file_format.write(path, payload)
        if then is not None:
            then()
    except Exception as err:
        _failed(err, path)


def _failed(err: BaseException, path: Path) -> None:
    """Keep a background write's error for the next save or wait, on the loop's thread; say it now, too, in
    case none comes."""
    global _error
    message = f"{type(err).__name__}: {err} (writing {str(path)!r} in the background)"
    with _lock:
        _error = message
    sys.stderr.write(f"speedups: a checkpoint could not be written: {message}\n")
    sys.stderr.flush()

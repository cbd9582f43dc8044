"""The files speedups keeps open, dropped in every child this process forks (a loader's workers, ``os.fork``).

``fork()`` copies every descriptor into the child, whatever ``os.set_inheritable`` says (that flag is for
``exec``), and the child's copy shares the parent's open file: its offset, an ``flock`` lock, and, in a
Python file object, the unwritten buffer. A DataLoader worker forked while a metric file is open holds that
file until it notices its parent died; a child that exits normally flushes the parent's buffered rows a
second time. :func:`drop_in_children` registers such a file: in every child forked through Python
(``os.fork``, ``multiprocessing``, DataLoader workers) its descriptor is pointed at ``/dev/null`` before the
child runs code of its own, so the child keeps nothing of it open and whatever the child's copy writes or
flushes goes nowhere. The parent's file is untouched. :func:`on_fork_in_child` runs a function there too
(a module's lock made anew: a thread of the parent may have held it at the fork).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import IO, Any

__all__ = ["drop_in_children", "on_fork_in_child"]

_FILES: weakref.WeakSet[IO[Any]] = weakref.WeakSet()  # the open files a forked child must not keep
_CALLS: list[Callable[[], None]] = []  # run in the child after the files are dropped
_GUARD = threading.Lock()
_hooked = False  # the at-fork hook is installed (once, at the first use: nothing happens at import)


def drop_in_children(file: IO[Any]) -> None:
    """Point ``file``'s descriptor at ``/dev/null`` in every child this process forks from now on.

    Forgotten when ``file`` is collected; a file closed before the fork is skipped. Windows has no fork:
    nothing to do there.
    """
    with _GUARD:
        if _hook():
            _FILES.add(file)


def on_fork_in_child(call: Callable[[], None]) -> None:
    """Run ``call()`` in every child this process forks from now on (once per function, however often
    registered), after the registered files were dropped."""
    with _GUARD:
        if _hook() and call not in _CALLS:
            _CALLS.append(call)


def _hook() -> bool:
    """Install the at-fork hook once (under ``_GUARD``); False where there is no fork (Windows)."""
    global _hooked
    if not hasattr(os, "register_at_fork"):  # pragma: no cover - Windows
        return False
    if not _hooked:
        os.register_at_fork(after_in_child=_in_child)
        _hooked = True
    return True


def _in_child() -> None:
    """In a freshly forked child: every registered file's descriptor becomes ``/dev/null`` (a ``dup2``, so
    the number stays taken: a later flush of the child's copy cannot land in a file the child opens), then
    the registered functions run."""
    global _GUARD
    _GUARD = threading.Lock()  # a thread of the parent may have held it at the fork
    files = list(_FILES)
    _FILES.clear()  # the child's own files are registered anew when it opens them
    if files:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            for file in files:
                try:
                    fd = file.fileno()
                except (ValueError, OSError):  # closed before the fork
                    continue
                with contextlib.suppress(OSError):
                    os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)
    for call in _CALLS:
        call()

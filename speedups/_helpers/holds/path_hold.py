"""One writer per path: an exclusive hold on a lock file, which dies with the process that took it."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO

from speedups._helpers.holds.fork_guard import drop_in_children, on_fork_in_child
from speedups.errors import SpeedupsError

try:  # POSIX; elsewhere only the holders of this process are kept apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["PathHold"]

_HELD: weakref.WeakValueDictionary[str, PathHold] = weakref.WeakValueDictionary()  # by real path
_TAKING = threading.Lock()  # one acquire at a time in this process: the registry is checked, then set
_BUSY = (errno.EACCES, errno.EAGAIN)  # what a lock held by another process answers


class PathHold:
    """Hold the lock file ``path`` alone, against other processes and other holders in this process.

    The lock is a POSIX record lock (``fcntl.lockf``), which belongs to the process that took it: the
    kernel drops it when that process ends, however (SIGKILL, OOM killer), and a child the process forked
    (a DataLoader worker) never holds it, so a killed run's directory is free at once even while its
    orphaned workers live. ``flock`` would not do: its lock belongs to the open file, which every forked
    child shares until it exits. Being per process, the lock does not tell two holders of one process apart
    (a second lock on the file succeeds, and closing any descriptor of the file would let the lock go):
    a registry of this process's holders refuses the second one before it opens the file. The file holds
    the holder's process id, for the message; its descriptor is dropped in forked children
    (:func:`~speedups._helpers.holds.fork_guard.drop_in_children`). A holder released, collected or alive at
    interpreter exit removes its lock file; a killed one leaves it behind, unlocked: the next holder takes it.

    Args:
        path: the lock file (made if missing, removed at :meth:`release`); its folder must exist.
        clash: the message when another holder has it, given that holder's process id (``os.getpid()``
            for a holder in this process; None when the file does not say).
    """

    def __init__(self, path: Path, clash: Callable[[int | None], str]) -> None:
        self.path = path
        self._clash = clash  # a plain function: a bound method of the owner would keep the owner alive
        self._file: IO[str] | None = None
        self._pid = 0  # the process that took the lock
        self._done: weakref.finalize | None = None  # release, also when collected or at interpreter exit

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now (a forked child's copy of a holder does not)."""
        return self._file is not None and self._pid == os.getpid()

    def acquire(self) -> None:
        """Take the lock (no wait); a second call while held does nothing.

        Raises:
            SpeedupsError: another holder of this process, or another process, holds it (``clash``'s
                message); the lock file cannot be made or locked (the message names the path and why).
        """
        if self.held:
            return
        self.release()  # a forked child's copy of a holder: forget the parent's file (never remove it)
        on_fork_in_child(_fresh_taking)
        with _TAKING:
            key = os.path.realpath(self.path)
            other = _HELD.get(key)
            if other is not None and other is not self and other.held:
                raise SpeedupsError(self._clash(os.getpid()))
            file = self._take()
            file.seek(0)
            file.truncate()
            file.write(f"{os.getpid()}\n")
            file.flush()
            drop_in_children(file)
            self._file, self._pid = file, os.getpid()
            self._done = weakref.finalize(self, _let_go, self.path, file, self._pid)
            _HELD[key] = self

    def _take(self) -> IO[str]:
        """The lock file at ``path``, open and locked by this process."""
        while True:
            try:
                file = open(self.path, "a+")  # noqa: SIM115 - held until release()
            except OSError as err:
                raise SpeedupsError(
                    f"cannot make the lock file {str(self.path)!r} ({type(err).__name__}: {err.strerror}). "
                    f"Pass a directory this process can write to."
                ) from None
            if fcntl is None:  # pragma: no cover - Windows
                return file
            try:
                fcntl.lockf(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                file.seek(0)
                holder = file.read().strip()
                file.close()  # this process holds no lock on the file: closing it lets nothing go
                if err.errno in _BUSY:
                    raise SpeedupsError(self._clash(int(holder) if holder.isdigit() else None)) from None
                raise SpeedupsError(
                    f"cannot lock {str(self.path)!r} ({type(err).__name__}: {err.strerror}): its file system "
                    f"has no POSIX locks (some network or FUSE mounts). Put the directory on a local disk "
                    f"or one with locks (NFS with lockd)."
                ) from None
            try:  # its last holder may have removed the file we opened: lock the file at the path
                opened, there = os.fstat(file.fileno()), os.stat(self.path)
                same = (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                return file
            file.close()

    def release(self) -> None:
        """Remove the lock file and let the lock go; does nothing when not held. In a forked child's copy
        of a holder, only forgets the file: the lock and the file are the parent's."""
        if self._done is None:
            return
        self._done()
        self._file, self._done = None, None
        key = os.path.realpath(self.path)
        if _HELD.get(key) is self:
            del _HELD[key]


def _let_go(path: Path, file: IO[str], pid: int) -> None:
    """Remove the lock file, then close it (which lets the lock go): removed while still held, so nobody
    took it in between. In another process than the holder (a forked child at its exit), only close this
    copy: the parent still holds the lock, and its file."""
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            os.unlink(path)
    file.close()


def _fresh_taking() -> None:
    """In a forked child: a new ``_TAKING`` (a thread of the parent may have held it at the fork)."""
    global _TAKING
    _TAKING = threading.Lock()

"""One writer per path: an exclusive hold on a lock file, which dies with the process that took it."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
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

    Two locks on two bytes of the file, each covering the other's gap. A POSIX record lock (``fcntl.lockf``,
    byte 0) belongs to the process that took it: the kernel drops it when that process ends, however
    (SIGKILL, OOM killer), and a child the process forked (a DataLoader worker) never holds it, so a killed
    run's directory is free at once even while its orphaned workers live. But it also goes when the process
    closes *any* descriptor of the file (``shutil.copytree`` of the run folder, a backup, a hash of every
    file): so the holder also takes an open-file-description lock (Linux ``F_OFD_SETLK``, byte 1), which
    belongs to its own open file and stays until that is closed. A forked child would share that open file:
    its descriptor is dropped in every child (:func:`~speedups._helpers.holds.fork_guard.drop_in_children`).
    A newcomer must get both. Record lock free but the other taken means the holder closed another
    descriptor (refused while the process named in the file lives on this host) or a dead holder's
    children kept the open file (a fork outside Python: the file is replaced by a fresh one, under the
    record lock). Where the system has no such lock (macOS), the record lock alone. Being per process,
    the record lock does not tell two holders of one process apart: a registry of this process's holders
    refuses the second one before it opens the file. The file holds the holder's process id and host, for
    the message and the check above. A holder released, collected or alive at interpreter exit removes
    its lock file; a killed one leaves it behind, unlocked: the next holder takes it.

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
            file.write(f"{os.getpid()}\n{socket.gethostname()}\n")
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
                fcntl.lockf(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError as err:
                holder = _holder(file)
                file.close()  # this process holds no lock on the file: closing it lets nothing go
                if err.errno in _BUSY:
                    raise SpeedupsError(self._clash(holder[0])) from None
                raise SpeedupsError(
                    f"cannot lock {str(self.path)!r} ({type(err).__name__}: {err.strerror}): its file system "
                    f"has no POSIX locks (some network or FUSE mounts). Put the directory on a local disk "
                    f"or one with locks (NFS with lockd)."
                ) from None
            if not _own_lock(file):  # the record lock is ours, the open file's lock another's
                pid, host = _holder(file)
                if pid is None or _alive_here(pid, host) is not False:
                    file.close()  # (lets our record lock go)
                    raise SpeedupsError(self._clash(pid))
                # A dead holder's children keep its open file (forked outside Python, where the fork guard
                # cannot drop it): under our record lock, replace the file by a fresh one and take that.
                with contextlib.suppress(OSError):
                    if _same_file(file, self.path):
                        os.unlink(self.path)
                file.close()
                continue
            if _same_file(file, self.path):  # its last holder may have removed the file we opened
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


def _same_file(file: IO[str], path: Path) -> bool:
    """Whether ``path`` still names the file ``file`` has open (not removed, nor replaced)."""
    try:
        opened, there = os.fstat(file.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (opened.st_dev, opened.st_ino) == (there.st_dev, there.st_ino)


def _own_lock(file: IO[str]) -> bool:
    """Take the open file's lock on byte 1 (Linux ``F_OFD_SETLK``); False when another open file holds it.
    True where the system has none (the record lock alone)."""
    command = getattr(fcntl, "F_OFD_SETLK", None)
    if command is None:  # pragma: no cover - not Linux
        return True
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 1, 1, 0)  # struct flock: byte 1, pid 0
    try:
        fcntl.fcntl(file.fileno(), command, request)
    except OSError as err:
        if err.errno in _BUSY:
            return False
        if err.errno == errno.EINVAL:  # pragma: no cover - a file system without them: the record lock
            return True
        raise
    return True


def _holder(file: IO[str]) -> tuple[int | None, str | None]:
    """The process id and host a holder wrote in the lock file (None where it does not say)."""
    file.seek(0)
    lines = file.read().split()
    pid = int(lines[0]) if lines and lines[0].isdigit() else None
    return pid, lines[1] if len(lines) > 1 else None


def _alive_here(pid: int, host: str | None) -> bool | None:
    """Whether process ``pid`` of ``host`` lives: None when it cannot be told (another host, or none said);
    a zombie (ended, not yet reaped) is dead."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


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

"""One writer per run file: an advisory lock on ``<file>.lock`` held while a file sink is open."""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from typing import IO

from speedups.errors import SpeedupsError

try:  # POSIX; elsewhere only the loggers of this process are kept apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["FileLock"]

_HELD: weakref.WeakValueDictionary[str, FileLock] = weakref.WeakValueDictionary()  # by real path


class FileLock:
    """Hold the lock file ``path`` alone, against other processes and other objects of this process.

    ``fcntl.flock`` locks belong to an open file: a second open of the same file conflicts even in the
    same process, and the kernel drops the lock when its file is closed, the holder garbage collected or
    its process killed (a crashed run leaves the file behind, never the lock: the next run takes it). The
    file holds the holder's process id, for the message. A registry of this process's holders names a
    clash within the process, where ``flock`` over NFS (emulated with POSIX locks, per process) would not.
    A holder collected or alive at interpreter exit removes its lock file; a killed one leaves it, unlocked.

    Args:
        path: the lock file (made if missing, removed at :meth:`release`).
        guards: the file the lock protects, named in messages.
    """

    def __init__(self, path: Path, guards: Path) -> None:
        self.path = path
        self.guards = guards
        self._file: IO[str] | None = None
        self._done: weakref.finalize | None = None  # release, also when collected or at interpreter exit

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock (no wait); a second call while held does nothing.

        Raises:
            SpeedupsError: another object of this process, or another process, holds it; the lock file
                cannot be made (the message names the path and the reason).
        """
        if self._file is not None:
            return
        key = os.path.realpath(self.path)
        other = _HELD.get(key)
        if other is not None and other is not self and other.held:
            raise SpeedupsError(self._clash("another MetricLogger of this process writes it"))
        while True:
            try:
                f = open(self.path, "a+")  # noqa: SIM115 - held until release()
            except OSError as err:
                raise SpeedupsError(
                    f"cannot make the lock file {str(self.path)!r} ({type(err).__name__}: {err.strerror}). "
                    f"Pass a log_dir this process can write to."
                ) from None
            if fcntl is None:  # pragma: no cover - Windows
                break
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held elsewhere (BlockingIOError), or a file system without locks
                f.seek(0)
                holder = f.read().strip()
                f.close()
                who = f"process {holder} holds it" if holder.isdigit() else "another process holds it"
                raise SpeedupsError(self._clash(f"another MetricLogger writes it ({who})")) from None
            try:  # its last holder may have removed the file we opened: lock the file at the path
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        self._done = weakref.finalize(self, _let_go, self.path, f)
        _HELD[key] = self

    def release(self) -> None:
        """Remove the lock file and let the lock go; does nothing when not held."""
        if self._file is None or self._done is None:
            return
        self._done()
        self._file = self._done = None
        key = os.path.realpath(self.path)
        if _HELD.get(key) is self:
            del _HELD[key]

    def _clash(self, who: str) -> str:
        folder = self.guards.parent
        return (
            f"{str(self.guards)!r} is taken: {who}. Two writers of one file would interleave or overwrite "
            f"each other's rows (an evaluation logger beside the training one, a notebook cell run twice). "
            f"Log both through one logger (logger.log(step, val_loss=...) adds a row at that step), close "
            f"the first (first_logger.close(), or a with-block), or give this one its own directory: "
            f"MetricLogger({str(folder / 'eval')!r})."
        )


def _let_go(path: Path, file: IO[str]) -> None:
    """Remove the lock file, then close it (which lets the lock go): removed while still held, so nobody
    took it in between."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    file.close()

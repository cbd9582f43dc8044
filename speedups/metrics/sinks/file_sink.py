"""The part every file sink shares: one text file, locked, kept open across writes, flushed and closed."""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from speedups._helpers.holds import PathHold, drop_in_children
from speedups.errors import SpeedupsWarning
from speedups.metrics.sinks.base import Sink

__all__ = ["FileSink"]

_Row = TypeVar("_Row")


class FileSink(Sink):
    """A sink writing ``path`` (see :class:`~speedups.metrics.sinks.csv_file.CSVSink` and
    :class:`~speedups.metrics.sinks.jsonl.JSONLinesSink`), one writer at a time.

    :meth:`claim` locks ``<path>.lock`` until :meth:`close` (a second logger on the file is refused; a
    crashed run's lock is gone with its process, even while children it forked live: see
    :class:`~speedups._helpers.holds.PathHold`). The file is opened on the first row: a resumed run keeps
    the rows up to its step; a new run moves an earlier run's file aside to ``<stem>.earlier-<n><suffix>``
    (n counting up) with a warning, so no row of it is lost.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._resume_after: int | None = None
        self._rows_at_step: int | None = None
        self._lock = PathHold(path.with_name(path.name + ".lock"), functools.partial(_clash, path))

    def claim(self) -> None:
        self._lock.acquire()

    def resume(self, after_step: int) -> None:
        self.resume_rows(after_step, None)

    def resume_rows(self, after_step: int, rows_at_step: int | None) -> None:
        self._resume_after = after_step
        self._rows_at_step = rows_at_step

    def _prepare(self) -> None:
        """Before the file is first opened: lock it (if not yet), make its directory, and move an earlier
        run's file aside when this is not a resumed run."""
        self._lock.acquire()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._resume_after is not None or not self.path.exists() or self.path.stat().st_size == 0:
            return
        aside = self._earlier_name()
        os.replace(self.path, aside)
        warnings.warn(
            f"MetricLogger: {str(self.path)!r} held the rows of an earlier run; they are kept in "
            f"{str(aside)!r} and this run writes a new {self.path.name}. To continue that run instead, load "
            f"the logger with its checkpoint (load_checkpoint(path, logger=logger)); to keep runs apart, "
            f"give each its own log_dir.",
            SpeedupsWarning,
            stacklevel=2,
        )

    def _create(self) -> IO[str]:
        """``path`` opened for writing from the start, kept open across writes; a child this process forks
        (a loader's worker) keeps nothing of it and never flushes this process's rows."""
        file = open(self.path, "w", newline="")  # noqa: SIM115 - kept open across writes, closed by close()
        drop_in_children(file)
        return file

    def _earlier_name(self) -> Path:
        """``<stem>.earlier-<n><suffix>`` beside the file, ``n`` one above the highest there."""
        stem, suffix = self.path.stem, self.path.suffix
        pattern = re.compile(re.escape(stem) + r"\.earlier-(\d+)" + re.escape(suffix) + "$")
        taken = [int(m.group(1)) for p in self.path.parent.iterdir() if (m := pattern.match(p.name))]
        return self.path.with_name(f"{stem}.earlier-{max(taken, default=0) + 1}{suffix}")

    def _kept(self, rows: Sequence[_Row], step_of: Callable[[_Row], int | None]) -> list[_Row]:
        """The rows a resumed run keeps: those before its step, and at its step the first ones written
        before the checkpoint was saved (all of them for a checkpoint that did not count them)."""
        after, at_step = self._resume_after, self._rows_at_step
        assert after is not None
        kept, seen = [], 0
        for row in rows:
            step = step_of(row)
            if step is None or step > after:
                continue
            if step == after:
                seen += 1
                if at_step is not None and seen > at_step:
                    continue
            kept.append(row)
        return kept

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
                self._file = None
        finally:
            self._lock.release()


def _clash(path: Path, holder: int | None) -> str:
    """The message when another logger holds ``path`` (``holder``: its process id, when known)."""
    if holder == os.getpid():
        who = "another MetricLogger of this process writes it"
    else:
        process = "another process" if holder is None else f"process {holder}"
        who = f"another MetricLogger writes it ({process} holds it)"
    return (
        f"{str(path)!r} is taken: {who}. Two writers of one file would interleave or overwrite each other's "
        f"rows (an evaluation logger beside the training one, a notebook cell run twice). Log both through "
        f"one logger (logger.log(step, val_loss=...) adds a row at that step), close the first "
        f"(first_logger.close(), or a with-block), or give this one its own directory: "
        f"MetricLogger({str(path.parent / 'eval')!r})."
    )

"""The part every file sink shares: one text file, kept open across writes, flushed and closed."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from speedups.metrics.sinks.base import Sink

__all__ = ["FileSink"]


class FileSink(Sink):
    """A sink writing ``path``, opened on the first row (see :class:`~speedups.metrics.sinks.csv_file.CSVSink`
    and :class:`~speedups.metrics.sinks.jsonl.JSONLinesSink`); a resumed run keeps the rows up to its step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._resume_after: int | None = None

    def resume(self, after_step: int) -> None:
        self._resume_after = after_step

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

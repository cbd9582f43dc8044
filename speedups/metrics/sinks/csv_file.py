"""A CSV file: one row per step, one column per metric (``step`` first), for spreadsheets and plots."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from speedups.metrics.sinks.base import Sink

__all__ = ["CSVSink"]


class CSVSink(Sink):
    """Rows of ``step,<metric>,...`` in ``path``; a metric that first appears later widens the file once
    (the header is rewritten, earlier rows get an empty cell). Opened when the first row is written: a new
    run starts the file afresh, a resumed one keeps the rows up to its step."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._resume_after: int | None = None

    def resume(self, after_step: int) -> None:
        self._resume_after = after_step

    def _rows_kept(self) -> list[dict[str, str]]:
        if self._resume_after is None or not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            self.columns = [c for c in (reader.fieldnames or []) if c != "step"]
            return [row for row in reader if row.get("step") and int(row["step"]) <= self._resume_after]

    def _open(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        if self._file is not None:
            self._file.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = columns
        self._file = open(self.path, "w", newline="")  # noqa: SIM115 - kept open across writes
        self._writer = csv.DictWriter(self._file, fieldnames=["step", *columns], restval="")
        self._writer.writeheader()
        self._writer.writerows(rows)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._file is None:
            kept = self._rows_kept()
            self._open(self.columns, kept)
        new = [name for name in values if name not in self.columns]
        if new:  # a wider header: rewrite what is there (rare: once per new metric)
            assert self._file is not None
            self._file.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self._open([*self.columns, *new], rows)
        assert self._writer is not None
        self._writer.writerow({"step": step, **{k: _cell(v) for k, v in values.items()}})

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _cell(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else str(float(value))

"""A CSV file: one row per step, one column per metric (``step`` first), for spreadsheets and plots."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path

from speedups.metrics.sinks.base import complete_lines
from speedups.metrics.sinks.file_sink import FileSink

__all__ = ["CSVSink"]


class CSVSink(FileSink):
    """Rows of ``step,<metric>,...`` in ``path``; a metric that first appears later widens the file once
    (the header is rewritten, earlier rows get an empty cell). Opened when the first row is written: a new
    run moves an earlier run's file aside (see :class:`~speedups.metrics.sinks.file_sink.FileSink`), a
    resumed one keeps the rows up to its step. Lines end in ``\n`` only (the csv module's default is
    ``\r\n``)."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.columns: list[str] = []
        self._known: set[str] = set()
        self._order: tuple[str, ...] = ()

    def _rows_kept(self) -> list[dict[str, str]]:
        if self._resume_after is None or not self.path.exists():
            return []
        lines = complete_lines(self.path)
        reader = csv.DictReader(lines)
        self.columns = [c for c in (reader.fieldnames or []) if c != "step"]
        return self._kept(list(reader), lambda row: int(row["step"]) if row.get("step") else None)

    def _open(self, columns: list[str], rows: list[dict[str, str]]) -> None:
        if self._file is not None:
            self._file.close()
        self.columns = columns
        self._known = set(columns)
        self._order = tuple(columns)
        self._file = self._create()
        writer = csv.DictWriter(self._file, fieldnames=["step", *columns], restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._file is None:
            self._prepare()
            kept = self._rows_kept()
            self._open(self.columns, kept)
        if len(values) > len(self._known) or not self._known.issuperset(values):
            # a wider header: rewrite what is there (rare: once per new metric)
            assert self._file is not None
            self._file.close()
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self._open([*self.columns, *(name for name in values if name not in self._known)], rows)
        assert self._file is not None
        # numbers only: no cell needs quoting; repr is the shortest exact text of a float ('nan', 'inf')
        if tuple(values) == self._order:  # every column, in order: the common row
            self._file.write(f"{step},{','.join(map(repr, values.values()))}\n")
            return
        cells = [repr(values[name]) if name in values else "" for name in self.columns]
        self._file.write(",".join([str(step), *cells]) + "\n")

    def write_rows(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        order = self._order
        if self._file is None or not all(tuple(values) == order for _, values in rows):
            super().write_rows(rows)  # a first row, or a row that is not every column in order
            return
        self._file.write("".join(f"{step},{','.join(map(repr, values.values()))}\n" for step, values in rows))

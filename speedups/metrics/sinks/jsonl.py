"""A JSON-lines file: one object per step, ``{"step": 3, "loss": 0.5, ...}``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from speedups.metrics.sinks.base import complete_lines
from speedups.metrics.sinks.file_sink import FileSink

__all__ = ["JSONLinesSink"]


class JSONLinesSink(FileSink):
    """One JSON object per row in ``path`` (NaN and infinities as ``null``: JSON has no such numbers; the
    CSV and TensorBoard sinks keep them). Opened when the first row is written: a new run moves an earlier
    run's file aside (see :class:`~speedups.metrics.sinks.file_sink.FileSink`), a resumed one keeps the
    lines up to its step."""

    name = "jsonl"

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._file is None:
            self._prepare()
            kept: list[str] = []
            if self._resume_after is not None and self.path.exists():
                lines = [line.rstrip("\r\n") for line in complete_lines(self.path) if line.strip()]
                kept = self._kept(lines, lambda line: json.loads(line).get("step"))
            self._file = self._create()
            self._file.writelines(line + "\n" for line in kept)
        row = {"step": step, **{k: (float(v) if math.isfinite(v) else None) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")

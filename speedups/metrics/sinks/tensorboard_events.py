"""TensorBoard event files through torch's ``SummaryWriter`` (the ``tensorboard`` package, an extra)."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedups.metrics.sinks.base import Sink

__all__ = ["TensorBoardSink"]

# Event files whose rows this sink wrote with one wall time per row (so a resume can tell the rows apart).
_SUFFIX = ".speedups"


class TensorBoardSink(Sink):
    """``SummaryWriter(log_dir).add_scalar(name, value, step)`` for every value. The writer is made when the
    first row is written; the scalars of one row share one wall time, later rows a later one.

    A resumed run passes ``purge_step``, so TensorBoard hides the events written after the checkpoint:
    after its step, and at its step the rows logged after the save (the checkpoint counts the rows logged
    before it). Those are hidden with the whole step and written again from the files (their values and
    wall times), so each row shows once, as in the CSV file. Where the directory holds event files that
    this sink did not write, rows at the step cannot be told apart and all of them are kept.

    Raises:
        ImportError: the ``tensorboard`` package is not installed (``pip install "speedups[tensorboard]"``),
            at construction.
    """

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ImportError(
                "MetricLogger(sinks='tensorboard'): the tensorboard package is not installed. Install the "
                "extra: pip install 'speedups[tensorboard]' (or pip install tensorboard), or use sinks='csv'."
            )
        self.log_dir = log_dir
        self._writer: Any = None
        self._purge: int | None = None
        self._keep_at: tuple[int, int] | None = None  # (step, rows): rows at the resumed step to keep
        self._wall = 0.0  # the last row's wall time: each row gets a later one

    def resume(self, after_step: int) -> None:
        self.resume_rows(after_step, None)

    def resume_rows(self, after_step: int, rows_at_step: int | None) -> None:
        self._purge = after_step + 1
        self._keep_at = None if rows_at_step is None or after_step < 0 else (after_step, rows_at_step)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._writer is None:
            self._open()
        self._add(step, values, max(time.time(), self._wall + 1e-6))

    def _open(self) -> None:
        """Make the writer; on a resume, write again the rows at the step that the checkpoint counted."""
        from torch.utils.tensorboard import SummaryWriter

        purge, kept = self._purge, []
        if self._keep_at is not None:
            step, rows = self._keep_at
            found = _rows_at(self.log_dir, step)
            if found is not None:  # hide the whole step (purge_step), then write the counted rows again
                purge, kept = step, [(step, wall, values) for wall, values in found[:rows]]
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge, filename_suffix=_SUFFIX)
        for step, wall, values in kept:
            self._add(step, values, wall)

    def _add(self, step: int, values: Mapping[str, float], wall: float) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step, walltime=wall)
        self._wall = wall

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _rows_at(log_dir: Path, step: int) -> list[tuple[float, dict[str, float]]] | None:
    """The rows TensorBoard shows at ``step`` in ``log_dir``, in the order written: ``(wall time, values)``.

    Read as TensorBoard reads the directory (every event file, a restart's ``purge_step`` applied). None
    where an event file there was not written by this sink (its rows cannot be told apart by wall time).
    """
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped,unused-ignore]
        SCALARS,
        EventAccumulator,
    )

    if not log_dir.is_dir():
        return []
    files = [p.name for p in log_dir.iterdir() if "tfevents" in p.name]
    if any(not name.endswith(_SUFFIX) for name in files):
        return None
    if not files:
        return []
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: every scalar, none sampled
    events.Reload()
    rows: dict[float, dict[str, float]] = {}
    for tag in events.Tags()[SCALARS]:
        for event in events.Scalars(tag):
            if event.step == step:
                rows.setdefault(event.wall_time, {})[tag] = event.value
    return sorted(rows.items())

"""The interface every metric sink implements: rows of ``(step, {name: value})`` written in step order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Sink", "complete_lines", "run_file"]


class Sink:
    """Where :class:`~speedups.MetricLogger` writes its rows (on the writing rank only).

    A new sink (a tracker of your own) is a subclass in a file of its own and, to be chosen by name, one
    entry in :data:`~speedups.metrics.sinks.registry.SINKS`; any object with ``log_metrics(dict, step)``
    works without either (:class:`~speedups.metrics.sinks.tracker.TrackerSink`).

    Attributes:
        name: the sink's short name (``"csv"``), used in messages.
    """

    name = "sink"

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Write one row: the values logged at ``step`` (Python floats, NaN and infinities included)."""
        raise NotImplementedError

    def write_rows(self, rows: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Write several rows ``(step, values)`` in order; by default one :meth:`write` each."""
        for step, values in rows:
            self.write(step, values)

    def claim(self) -> None:
        """Take what this sink alone may write, before its first row: a file sink locks its file.

        Called on the writing rank when the logger is made (or at its first write where the rank is not yet
        known); released by :meth:`close`. By default nothing.

        Raises:
            SpeedupsError: another writer holds it (the message names the file and the fixes).
        """

    def resume(self, after_step: int) -> None:
        """A resumed run appends after ``after_step``: forget (or hide) whatever was written later
        (``-1``: the checkpoint was saved before any row, so every row written is later)."""

    def resume_rows(self, after_step: int, rows_at_step: int | None) -> None:
        """Like :meth:`resume`, and of the rows written at ``after_step`` itself keep only the first
        ``rows_at_step`` (the ones logged before the checkpoint was saved; None: all of them). By default
        :meth:`resume` (a sink that cannot drop single rows keeps them all)."""
        self.resume(after_step)

    def flush(self) -> None:
        """Make what was written durable (a file flushed, a tracker's buffer sent)."""

    def close(self) -> None:
        """Flush and release the sink's resources; called once."""
        self.flush()


def run_file(log_dir: Path | None, name: str, sink: str) -> Path:
    """The file ``name`` in ``log_dir`` for a file sink (the directory is made when first written).

    Raises:
        ValueError: no ``log_dir`` was given.
    """
    if log_dir is None:
        raise ValueError(
            f"MetricLogger(sinks={sink!r}): a {sink} sink writes a file, so it needs log_dir. Write "
            f"MetricLogger('runs/my_run', sinks={sink!r})."
        )
    return log_dir / name


def complete_lines(path: Path) -> list[str]:
    """The lines of a run file that were written whole (each with its newline): a process killed while
    writing leaves a cut last line, which a resumed run drops instead of keeping a fragment."""
    with open(path, newline="") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return lines

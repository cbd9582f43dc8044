"""Any experiment tracker with ``log_metrics(metrics, step)`` (Lightning's loggers, your own class)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from speedups.metrics.sinks.base import Sink

__all__ = ["TrackerSink"]


class TrackerSink(Sink):
    """Forwards every row to ``tracker.log_metrics(dict(values), step)``; ``flush``/``close`` are called
    on the tracker where it has them (``save``/``finalize`` are its own business)."""

    name = "tracker"

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self.tracker.log_metrics(dict(values), step)

    def flush(self) -> None:
        if callable(getattr(self.tracker, "flush", None)):
            self.tracker.flush()

    def close(self) -> None:
        self.flush()
        if callable(getattr(self.tracker, "close", None)):
            self.tracker.close()

"""The sinks chosen by name: one line each. A sink object, or any object with ``log_metrics(dict, step)``,
is taken as it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from speedups._helpers.validate import short
from speedups.metrics.sinks.base import Sink, run_file
from speedups.metrics.sinks.csv_file import CSVSink
from speedups.metrics.sinks.jsonl import JSONLinesSink
from speedups.metrics.sinks.mlflow_run import MLflowSink
from speedups.metrics.sinks.tensorboard_events import TensorBoardSink
from speedups.metrics.sinks.tracker import TrackerSink
from speedups.metrics.sinks.wandb_run import WandbSink

__all__ = ["SINKS", "make_sink"]

SINKS: dict[str, Callable[[Path | None], Sink]] = {
    "csv": lambda log_dir: CSVSink(run_file(log_dir, "metrics.csv", "csv")),
    "jsonl": lambda log_dir: JSONLinesSink(run_file(log_dir, "metrics.jsonl", "jsonl")),
    "tensorboard": lambda log_dir: TensorBoardSink(run_file(log_dir, "tensorboard", "tensorboard")),
    "wandb": lambda log_dir: WandbSink(log_dir),
    "mlflow": lambda log_dir: MLflowSink(),
}


def make_sink(spec: Any, log_dir: Path | None) -> Sink:
    """The sink for ``spec``: a name of :data:`SINKS`, a :class:`Sink`, or a tracker with ``log_metrics``.

    Raises:
        ValueError: an unknown name, or a file sink without ``log_dir``.
        TypeError: neither a name, a Sink nor an object with ``log_metrics``.
        ImportError: the sink's optional package is not installed (the message names the extra).
    """
    if isinstance(spec, Sink):
        return spec
    if isinstance(spec, str):
        make = SINKS.get(spec)
        if make is None:
            raise ValueError(
                f"MetricLogger(sinks={spec!r}): unknown sink. Choose among {sorted(SINKS)}, or pass a sink "
                f"object or a tracker with log_metrics(metrics, step)."
            )
        return make(log_dir)
    if callable(getattr(spec, "log_metrics", None)):
        return TrackerSink(spec)
    raise TypeError(
        f"MetricLogger(sinks={short(spec)}): expected a sink name ({', '.join(sorted(SINKS))}), a "
        f"speedups.metrics.sinks.Sink, or an object with log_metrics(metrics, step)."
    )

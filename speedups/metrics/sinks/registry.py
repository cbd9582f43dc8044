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

__all__ = ["SINKS", "make_sink", "sink_named"]

SINKS: dict[str, Callable[[Path | None], Sink]] = {
    "csv": lambda log_dir: CSVSink(run_file(log_dir, "metrics.csv", "csv")),
    "jsonl": lambda log_dir: JSONLinesSink(run_file(log_dir, "metrics.jsonl", "jsonl")),
    "tensorboard": lambda log_dir: TensorBoardSink(run_file(log_dir, "tensorboard", "tensorboard")),
    "wandb": lambda log_dir: WandbSink(log_dir),
    "mlflow": lambda log_dir: MLflowSink(),
}


def sink_named(name: str) -> Callable[[Path | None], Sink]:
    """The maker of the sink called ``name`` in :data:`SINKS`.

    Raises:
        ValueError: no sink has that name (the message lists the names).
    """
    make = SINKS.get(name)
    if make is None:
        raise ValueError(
            f"sinks={name!r}: unknown sink. Choose among {sorted(SINKS)}, or pass a sink object or a tracker "
            f"with log_metrics(metrics, step)."
        )
    return make


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
        return sink_named(spec)(log_dir)
    if callable(getattr(spec, "log_metrics", None)):
        return TrackerSink(spec)
    raise TypeError(
        f"MetricLogger(sinks={short(spec)}): expected a sink name ({', '.join(sorted(SINKS))}), a "
        f"speedups.metrics.sinks.Sink, or an object with log_metrics(metrics, step)."
    )

"""Metrics every step at no sync: :class:`MetricLogger` and its sinks (CSV, JSON lines, TensorBoard,
W&B, MLflow, any tracker with ``log_metrics``)."""

from speedups.metrics.curves import plot_metrics, read_metrics
from speedups.metrics.logger import MetricLogger

__all__ = ["MetricLogger", "plot_metrics", "read_metrics"]

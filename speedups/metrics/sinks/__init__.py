"""Where a :class:`~speedups.MetricLogger` writes: one small class per sink behind :class:`Sink`."""

from speedups.metrics.sinks.base import Sink
from speedups.metrics.sinks.csv_file import CSVSink
from speedups.metrics.sinks.file_sink import FileSink
from speedups.metrics.sinks.jsonl import JSONLinesSink
from speedups.metrics.sinks.mlflow_run import MLflowSink
from speedups.metrics.sinks.registry import SINKS, make_sink
from speedups.metrics.sinks.tensorboard_events import TensorBoardSink
from speedups.metrics.sinks.tracker import TrackerSink
from speedups.metrics.sinks.wandb_run import WandbSink

__all__ = [
    "SINKS",
    "CSVSink",
    "FileSink",
    "JSONLinesSink",
    "MLflowSink",
    "Sink",
    "TensorBoardSink",
    "TrackerSink",
    "WandbSink",
    "make_sink",
]

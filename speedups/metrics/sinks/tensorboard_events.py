"""TensorBoard event files through torch's ``SummaryWriter`` (the ``tensorboard`` package, an extra)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedups.metrics.sinks.base import Sink

__all__ = ["TensorBoardSink"]


class TensorBoardSink(Sink):
    """``SummaryWriter(log_dir).add_scalar(name, value, step)`` for every value. The writer is made when the
    first row is written; a resumed run passes ``purge_step``, so TensorBoard hides the events written
    after the checkpoint's step.

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

    def resume(self, after_step: int) -> None:
        self._purge = after_step + 1

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge)
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

"""Weights & Biases, through its own client (the ``wandb`` package, an extra; ``mode="offline"`` needs no
network)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedups.metrics.sinks.base import Sink

__all__ = ["WandbSink"]


class WandbSink(Sink):
    """``run.log(values, step=step)`` on a W&B run: the one given, else ``wandb.init(dir=log_dir,
    **init_kwargs)`` made when the first row is written (and finished at close).

    Raises:
        ImportError: the ``wandb`` package is not installed (``pip install "speedups[wandb]"``), at
            construction.
    """

    name = "wandb"

    def __init__(self, log_dir: Path | None = None, *, run: Any = None, **init_kwargs: Any) -> None:
        try:
            self._wandb = importlib.import_module("wandb")
        except ImportError:
            raise ImportError(
                "MetricLogger(sinks='wandb'): the wandb package is not installed. Install the extra: "
                "pip install 'speedups[wandb]' (or pip install wandb), or use sinks='csv'."
            ) from None
        self._run = run
        self._own = run is None
        self._init = {**({"dir": str(log_dir)} if log_dir is not None else {}), **init_kwargs}

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._run is None:
            if self._init.get("dir"):
                Path(self._init["dir"]).mkdir(parents=True, exist_ok=True)
            self._run = self._wandb.init(**self._init)
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        if self._own and self._run is not None:
            self._run.finish()
            self._run = None

"""Weights & Biases, through its own client (the ``wandb`` package, an extra; ``mode="offline"`` needs no
network)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from speedups._helpers import env
from speedups.errors import SpeedupsError
from speedups.metrics.sinks.base import Sink

__all__ = ["WandbSink"]


class WandbSink(Sink):
    """``run.log(values, step=step)`` on a W&B run: the one given, else ``wandb.init(dir=log_dir,
    **init_kwargs)`` made here on rank 0 (so a missing API key fails now, not at the first write) and
    finished at close. Without network, run offline: ``WANDB_MODE=offline`` or ``mode="offline"``.

    Raises:
        ImportError: the ``wandb`` package is not installed (``pip install "speedups[wandb]"``), at
            construction.
        SpeedupsError: ``wandb.init`` failed (no API key: ``wandb login``, or run offline).
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
        if self._run is None and env.rank() == 0:  # the writer: fail here rather than at step 10,000
            self._start()

    def _start(self) -> None:
        if self._init.get("dir"):
            Path(self._init["dir"]).mkdir(parents=True, exist_ok=True)
        try:
            self._run = self._wandb.init(**self._init)
        except Exception as err:
            raise SpeedupsError(
                f"MetricLogger(sinks='wandb'): wandb.init failed ({type(err).__name__}: {err}). Log in "
                f"(`wandb login`), or run without network: WANDB_MODE=offline (sync later with `wandb sync`)."
            ) from err

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._run is None:
            self._start()
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        if self._own and self._run is not None:
            self._run.finish()
            self._run = None

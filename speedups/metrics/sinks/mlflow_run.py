"""MLflow, through its own client (the ``mlflow-skinny`` package, an extra; a local tracking URI needs no
server)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

from speedups.errors import SpeedupsError
from speedups.metrics.sinks.base import Sink

__all__ = ["MLflowSink"]


class MLflowSink(Sink):
    """``MlflowClient.log_batch`` into a run: ``run_id`` if given, else the active run
    (``mlflow.start_run()`` in the script), else a new run of ``experiment`` made when the first row is
    written (and ended at close).

    Raises:
        ImportError: the ``mlflow`` package is not installed (``pip install "speedups[mlflow]"``), at
            construction.
        SpeedupsError: MLflow cannot open its tracking store (the message says how to point it at one).
    """

    name = "mlflow"

    def __init__(
        self, *, run_id: str | None = None, experiment: str = "speedups", tracking_uri: str | None = None
    ) -> None:
        try:
            self._mlflow = importlib.import_module("mlflow")
            self._entities = importlib.import_module("mlflow.entities")
        except ImportError:
            raise ImportError(
                "MetricLogger(sinks='mlflow'): the mlflow package is not installed. Install the extra: "
                "pip install 'speedups[mlflow]' (or pip install mlflow-skinny), or use sinks='csv'."
            ) from None
        try:
            self._client: Any = self._mlflow.MlflowClient(tracking_uri=tracking_uri)
        except Exception as err:  # e.g. MLflow 3's default sqlite store without sqlalchemy
            raise SpeedupsError(
                f"MetricLogger(sinks='mlflow'): MLflow could not open its tracking store "
                f"({type(err).__name__}: {err}). Set MLFLOW_TRACKING_URI to a server, or to a local store "
                f"(file:./mlruns, with MLFLOW_ALLOW_FILE_STORE=true on MLflow 3), or pass "
                f"MLflowSink(tracking_uri=...)."
            ) from err
        self._run_id = run_id
        self._experiment = experiment
        self._own = False

    def write(self, step: int, values: Mapping[str, float]) -> None:
        if self._run_id is None:
            active = self._mlflow.active_run()
            if active is not None:
                self._run_id = active.info.run_id
            else:
                found = self._client.get_experiment_by_name(self._experiment)
                experiment_id = (
                    found.experiment_id if found else self._client.create_experiment(self._experiment)
                )
                self._run_id = self._client.create_run(experiment_id).info.run_id
                self._own = True
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, float(v), now, step) for k, v in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        if self._own and self._run_id is not None:
            self._client.set_terminated(self._run_id)
            self._own = False

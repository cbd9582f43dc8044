"""MetricLogger: values written equal values logged, no sync per log, one writer, exact resume, sinks."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speedups import (
    LossTracker,
    MetricLogger,
    SpeedupsError,
    SpeedupsWarning,
    accumulate,
    load_checkpoint,
    save_checkpoint,
)
from speedups.metrics import logger as logger_module
from speedups.metrics.sinks import Sink
from tests._models import linear_data, total_norm, twin
from tests._sync_counter import SyncCounter


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _logged(steps: int = 6) -> list[tuple[int, dict]]:
    g = torch.Generator().manual_seed(0)
    return [
        (s, {"loss": torch.rand((), generator=g), "lr": 0.1 / (s + 1), "tokens": 32 * s})
        for s in range(steps)
    ]


def test_csv_and_jsonl_rows_are_the_values_logged(tmp_path: Path) -> None:
    tracker = LossTracker()
    with MetricLogger(tmp_path, sinks=["csv", "jsonl"]) as logger:
        for step, values in _logged():
            tracker.update(values["loss"], 4)
            logger.log(step, **values, mean=tracker, **({"eval": 0.5} if step == 3 else {}))
    rows = _rows(tmp_path / "metrics.csv")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == [line["step"] for line in lines] == list(range(6))
    losses = [values["loss"].item() for _, values in _logged()]
    for row, line, (step, values) in zip(rows, lines, _logged(), strict=True):
        assert float(row["loss"]) == line["loss"] == values["loss"].item()  # float64 round trip: exact
        assert float(row["lr"]) == values["lr"] and float(row["tokens"]) == 32 * step
        assert float(row["mean"]) == pytest.approx(sum(losses[: step + 1]) / (step + 1), rel=1e-12)
        assert row["eval"] == ("0.5" if step == 3 else "")  # a metric that appears later widens the file


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_events_read_back_equal_the_values_logged(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricLogger(tmp_path, sinks="tensorboard") as logger:
        for step, values in _logged():
            logger.log(step, **values)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr", "tokens"]
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    want = [(s, values["loss"].item()) for s, values in _logged()]
    assert [s for s, _ in got] == [s for s, _ in want]
    assert all(math.isclose(a, b, rel_tol=1e-7) for (_, a), (_, b) in zip(got, want, strict=True))  # float32


def test_log_makes_no_sync_device_values_are_read_at_the_flush(monkeypatch, tmp_path: Path) -> None:
    from speedups import tracking

    monkeypatch.setattr(logger_module, "_CPU_READS_ARE_FREE", False)  # CPU tensors stand in for a GPU's
    monkeypatch.setattr(tracking, "_CPU_READS_ARE_FREE", False)
    tracker = LossTracker()
    logger = MetricLogger(tmp_path, sinks="csv", every=10)
    with SyncCounter() as counter:
        for step, values in _logged():
            tracker.update(values["loss"])
            logger.log(step, **values, norm=values["loss"] * 2, mean=tracker)
        shown = logger.postfix()
    assert counter.count == 0  # five metrics a step, six steps, and the postfix: nothing read yet
    assert shown == {"lr": f"{0.1 / 6:.4g}", "tokens": "160"}  # host values only, the latest
    assert not (tmp_path / "metrics.csv").exists()
    with SyncCounter() as counter:
        logger.flush()
    assert 0 < counter.count <= len(_logged())  # one read per record, at the flush
    assert [int(r["step"]) for r in _rows(tmp_path / "metrics.csv")] == list(range(6))
    for step in range(6, 26):  # every=10: a flush every ten records, never more pending
        logger.log(step, loss=torch.tensor(1.0))
        assert len(logger._pending) < 10
    logger.close()
    assert len(_rows(tmp_path / "metrics.csv")) == 26


def test_a_resumed_run_writes_every_step_once(tmp_path: Path) -> None:
    """Save at step 5, go on to step 8, crash; the resumed run appends from step 6: no duplicate, no gap."""
    logger = MetricLogger(tmp_path, sinks=["csv", "jsonl"])
    for step in range(9):
        logger.log(step, loss=torch.tensor(float(step)))
        if step == 5:
            save_checkpoint(tmp_path / "ckpt.pt", logger=logger, step=step)
    logger.close()  # the crash: rows 6..8 were written but the checkpoint knows step 5
    resumed = MetricLogger(tmp_path, sinks=["csv", "jsonl"])
    assert load_checkpoint(tmp_path / "ckpt.pt", logger=resumed)["step"] == 5
    with pytest.raises(ValueError, match=r"steps must not go back; the last one logged was 5"):
        resumed.log(4, loss=0.0)
    for step in range(6, 12):
        resumed.log(step, loss=100.0 + step)
    resumed.close()
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(12))
    assert [float(r["loss"]) for r in rows] == [*map(float, range(6)), *(100.0 + s for s in range(6, 12))]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(12))


def test_accumulate_updates_are_logged_through_the_hook(tmp_path: Path) -> None:
    X, Y = linear_data(24)
    model, opt, ref, _ = twin()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    train_step = accumulate(2, opt, scheduler=sched, max_grad_norm=10.0)(lambda x, y: F.mse_loss(model(x), y))
    with MetricLogger(tmp_path) as logger:
        train_step.on_update(logger.log_update)
        for i in range(0, 24, 4):
            train_step(X[i : i + 4], Y[i : i + 4])
    rows = _rows(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3] and [float(r["lr"]) for r in rows] == [
        0.1,
        0.05,
        0.025,
    ]
    first = F.mse_loss(ref(X[:8]), Y[:8])  # the first window's mean loss, and its gradient's norm
    first.backward()
    norm = total_norm([p.grad for p in ref.parameters()])
    assert float(rows[0]["loss"]) == pytest.approx(first.item(), rel=1e-6)
    assert float(rows[0]["grad_norm"]) == pytest.approx(norm.item(), rel=1e-6)
    assert logger.postfix()["lr"] == "0.025"  # host values of the last row, formatted for tqdm


@pytest.mark.parametrize("items", [None, "int", "tensor"])
def test_an_updates_loss_totals_are_its_sum_and_count_made_without_a_sync(items: str | None) -> None:
    X, Y = linear_data(24)
    model, opt, _, _ = twin()
    sizes = [3, 5, 1, 4, 2, 6]

    def loss_fn(i: int):
        x, y = X[i * 4 : i * 4 + sizes[i]], Y[i * 4 : i * 4 + sizes[i]]
        loss = F.mse_loss(model(x), y)
        return loss if items is None else (loss, len(y) if items == "int" else torch.tensor(len(y)))

    train_step = accumulate(3, opt)(loss_fn)
    records: list = []
    totals: list = []

    def keep(record) -> None:
        with SyncCounter() as counter:
            totals.append(record.loss_totals())
        assert counter.count == 0
        records.append(record)

    train_step.on_update(keep)
    losses = []
    for i in range(6):
        with torch.no_grad():
            x, y = X[i * 4 : i * 4 + sizes[i]], Y[i * 4 : i * 4 + sizes[i]]
            losses.append((F.mse_loss(model(x), y).item(), len(y)))  # before this window's update
        train_step(i)
    for window, (record, pair) in enumerate(zip(records, totals, strict=True)):
        part = losses[window * 3 : window * 3 + 3]
        if items is None:  # the calls' losses and the number of calls
            want = [sum(v for v, _ in part), 3.0]
        else:  # the items' summed loss and the number of items
            want = [sum(v * n for v, n in part), float(sum(n for _, n in part))]
        assert pair.dtype == torch.float64 and pair.shape == (2,)
        assert pair.tolist() == pytest.approx(want, rel=1e-6)
        assert (pair[0] / pair[1]).item() == pytest.approx(record.loss.item(), rel=1e-6)


class _Tracker:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((step, metrics))


def test_any_tracker_with_log_metrics_and_a_sink_object_take_the_rows() -> None:
    class Collect(Sink):
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict]] = []

        def write(self, step, values) -> None:
            self.rows.append((step, dict(values)))

    tracker, sink = _Tracker(), Collect()
    with MetricLogger(sinks=[tracker, sink]) as logger:
        logger.log(3, loss=torch.tensor(0.25), skipped=None)  # None: no value at this step
        logger.log(4, loss=0.5)
    assert tracker.rows == sink.rows == [(3, {"loss": 0.25}), (4, {"loss": 0.5})]


def test_the_wandb_sink_logs_each_row_at_its_step() -> None:
    pytest.importorskip("wandb")
    from speedups.metrics.sinks import WandbSink

    class Run:
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict]] = []

        def log(self, values: dict, step: int) -> None:
            self.rows.append((step, values))

    run = Run()
    with MetricLogger(sinks=WandbSink(run=run)) as logger:
        logger.log(2, loss=torch.tensor(0.5), lr=0.1)
        logger.log(3, loss=0.25)
    assert run.rows == [(2, {"loss": 0.5, "lr": 0.1}), (3, {"loss": 0.25})]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_run_made_by_the_sink_takes_the_rows_and_finishes(tmp_path: Path, monkeypatch) -> None:
    import os

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        with MetricLogger(tmp_path, sinks="wandb") as logger:
            for step in range(3):
                logger.log(step, loss=float(step) / 2)
        assert logger.sinks[0]._run is None  # its own run, finished at close
        assert len(list(tmp_path.glob("wandb/offline-run-*/*.wandb"))) == 1
    finally:
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)  # set by wandb for its service process


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_mlflow_local_store_gets_the_rows(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    from speedups.metrics.sinks import MLflowSink

    uri = (tmp_path / "mlruns").as_uri()
    sink = MLflowSink(tracking_uri=uri, experiment="speedups-test")
    with MetricLogger(sinks=sink) as logger:
        for step in range(3):
            logger.log(step, loss=float(step) / 2)
    history = MlflowClient(tracking_uri=uri).get_metric_history(sink._run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.5), (2, 1.0)]


def test_a_missing_optional_package_is_an_error_at_construction(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"tensorboard package is not installed.*speedups\[tensorboard\]"):
        MetricLogger("runs/x", sinks="tensorboard")


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [
        (lambda: MetricLogger(sinks="csv"), ValueError, r"a csv sink writes a file, so it needs log_dir"),
        (lambda: MetricLogger("r", sinks="excel"), ValueError, r"unknown sink. Choose among \['csv'"),
        (lambda: MetricLogger("r", sinks=[]), ValueError, r"sinks=\[\]: expected at least one sink"),
        (lambda: MetricLogger("r", sinks=3), TypeError, r"expected a sink name"),
        (lambda: MetricLogger("r", every=0), ValueError, r"every=0: must be an int >= 1"),
        (lambda: MetricLogger(5), TypeError, r"log_dir=5: expected a directory name"),
    ],
)
def test_bad_arguments_are_refused_by_name(make, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        make()


def test_bad_values_and_use_after_close_are_refused(tmp_path: Path) -> None:
    logger = MetricLogger(tmp_path)
    with pytest.raises(ValueError, match=r"loss=<tensor of shape \(3,\)>\): a metric is one real number"):
        logger.log(0, loss=torch.ones(3))
    with pytest.raises(TypeError, match=r"name='x'.*expected a number, a one-element real tensor"):
        logger.log(0, name="x")
    with pytest.raises(TypeError, match=r"step='1'\): expected an int"):
        logger.log("1", loss=1.0)
    logger.close()
    with pytest.raises(SpeedupsError, match="the logger is closed"):
        logger.log(1, loss=1.0)
    with pytest.raises(ValueError, match=r"expected what MetricLogger.state_dict\(\) returns"):
        MetricLogger(tmp_path).load_state_dict({"step": -3})


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_write_one_file_with_the_global_values_one_collective_per_flush(tmp_path: Path) -> None:
    from tests._dist import WORKERS, run_torchrun

    out = run_torchrun(WORKERS / "metric_logger_ranks.py", [str(tmp_path)], nproc=2, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert sorted(line for line in out.stdout.splitlines() if "all_reduces" in line) == [
        "rank0 all_reduces=3",  # every=4 over 10 steps: flushes after steps 3 and 7, and at close
        "rank1 all_reduces=3",
    ]
    for folder in (tmp_path, tmp_path / "device"):  # values read at the log, or staged as device values
        rows = _rows(folder / "metrics.csv")
        assert [int(r["step"]) for r in rows] == [*range(10), 9]
        assert [float(r["loss"]) for r in rows[:10]] == [step + 0.5 for step in range(10)]  # mean of 2 ranks
        assert all(float(r["seen"]) == pytest.approx((1 * 1 + 4 * 3) / 4) for r in rows[:10])  # weighted by n
        assert all(float(r["lr"]) == pytest.approx(0.15, abs=1e-15) for r in rows[:10])
        assert rows[10]["eval"] == "0.5" and rows[10]["loss"] == ""
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["device", "metrics.csv", "metrics.jsonl", "odd", "rank0"]  # one writer, no lock left
    assert list((tmp_path / "odd").iterdir()) == []  # made when the logger was; nothing written
    refused = sorted(line for line in out.stdout.splitlines() if "refused" in line)
    assert [line[:14] for line in refused] == ["rank0 refused:", "rank1 refused:"]
    assert all("do not agree on what to reduce" in line and "grad_norm" in line for line in refused)
    own = _rows(tmp_path / "rank0" / "metrics.csv")
    assert [float(r["loss"]) for r in own] == [float(step) for step in range(10)]  # rank 0's values, once


# ------------------------------------------------------------------------ what a new user ran into (review)
def test_rows_without_values_write_nothing_and_later_columns_widen_the_file(tmp_path: Path) -> None:
    with MetricLogger(tmp_path, sinks=["csv", "jsonl"]) as logger:
        logger.log(0, grad_norm=None)  # nothing to write at step 0
        logger.log(1)
        logger.log(2, a=1.0)
        logger.log(3, b=2.0)
    assert _rows(tmp_path / "metrics.csv") == [
        {"step": "2", "a": "1.0", "b": ""},
        {"step": "3", "a": "", "b": "2.0"},
    ]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        2,
        3,
    ]


@pytest.mark.parametrize(
    ("log", "error", "pattern"),
    [
        (lambda lg: lg.log(0, step=5.0), ValueError, r"'step' is the row's own column"),
        (lambda lg: lg.log(-1, a=1.0), ValueError, r"log\(step=-1\): expected a step >= 0"),
        (lambda lg: lg.log(0, a=10**400), ValueError, r"a=.*too large for a float"),
        (lambda lg: lg.log(0, a=torch.zeros((), device="meta")), ValueError, r"meta tensor has no value"),
        (lambda lg: lg.log(0, a=np.bool_(True)), TypeError, r"expected a number.*got bool"),
        (lambda lg: lg.log_update(None), TypeError, r"expected the UpdateRecord"),
        (lambda lg: lg.postfix(digits=-1), ValueError, r"digits=-1"),
    ],
)
def test_bad_values_are_refused_at_log_naming_the_metric(
    tmp_path: Path, log, error: type, pattern: str
) -> None:
    logger = MetricLogger(tmp_path, every=1)
    with pytest.raises(error, match=pattern):
        log(logger)
    logger.log(0, ok=1.0)  # nothing was staged by the refused call
    logger.close()
    assert _rows(tmp_path / "metrics.csv") == [{"step": "0", "ok": "1.0"}]


def test_a_sparse_device_tensor_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(logger_module, "_CPU_READS_ARE_FREE", False)  # CPU tensors stand in for a GPU's
    with pytest.raises(ValueError, match=r"a=<torch.sparse_coo tensor>\): expected a dense tensor"):
        MetricLogger(tmp_path).log(0, a=torch.eye(1).to_sparse())


def test_numpy_scalars_are_numbers(tmp_path: Path) -> None:
    with MetricLogger(tmp_path) as logger:
        logger.log(0, a=np.float32(0.5), b=np.int64(3), c=np.float64(0.25))
    assert _rows(tmp_path / "metrics.csv") == [{"step": "0", "a": "0.5", "b": "3.0", "c": "0.25"}]


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda d: MetricLogger(d / "file.txt"), r"log_dir=.*file\.txt' is a file"),
        (lambda d: MetricLogger(d, sinks=["csv", "csv"]), r"'csv' twice"),
        (lambda d: MetricLogger(d, sinks="excel", enabled=False), r"sinks='excel': unknown sink"),
        (lambda d: MetricLogger(d, sinks=()), r"sinks=\(\): expected at least one sink"),
    ],
)
def test_bad_constructions_are_refused(tmp_path: Path, make, pattern: str) -> None:
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match=pattern):
        make(tmp_path)


class _Flaky:
    """A tracker whose fifth row fails (a network hiccup)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        if step == 4:
            raise ConnectionError("tracker unreachable")
        self.rows.append(step)


def test_a_failing_sink_costs_its_own_rows_only_and_is_named(tmp_path: Path) -> None:
    flaky = _Flaky()
    logger = MetricLogger(tmp_path, sinks=[flaky, "csv"], every=4)
    with pytest.raises(SpeedupsError, match=r"'tracker' sink failed to write steps 4\.\.7 \(ConnectionError"):
        for step in range(12):
            logger.log(step, loss=float(step))
    for step in range(8, 12):
        logger.log(step, loss=float(step))
    logger.close()
    assert [int(r["step"]) for r in _rows(tmp_path / "metrics.csv")] == list(
        range(12)
    )  # the CSV has them all
    assert flaky.rows == [0, 1, 2, 3, 8, 9, 10, 11]


def test_the_blocks_own_error_is_not_replaced_by_a_sink_failing_at_exit(tmp_path: Path) -> None:
    flaky = _Flaky()
    with (
        pytest.raises(KeyError, match="the user's"),
        pytest.warns(SpeedupsWarning, match="closing after an error"),
        MetricLogger(tmp_path, sinks=[flaky, "csv"]) as logger,
    ):
        for step in range(6):
            logger.log(step, loss=float(step))
        raise KeyError("the user's")
    assert len(_rows(tmp_path / "metrics.csv")) == 6  # the other sink was written and closed


@pytest.mark.parametrize("sinks", [["csv"], ["jsonl"]])
def test_a_resume_drops_a_line_cut_by_a_kill(tmp_path: Path, sinks: list[str]) -> None:
    logger = MetricLogger(tmp_path, sinks=sinks)
    for step in range(10):
        logger.log(step, loss=float(step))
        if step == 5:
            save_checkpoint(tmp_path / "ckpt.pt", logger=logger)
    logger.close()
    path = tmp_path / ("metrics.csv" if sinks == ["csv"] else "metrics.jsonl")
    text = path.read_text()
    path.write_text(
        text[: text.index("8") + 1]
    )  # killed while writing step 8's line: "...\n8" or '{"step": 8'
    resumed = MetricLogger(tmp_path, sinks=sinks)
    load_checkpoint(tmp_path / "ckpt.pt", logger=resumed)
    for step in range(6, 9):
        resumed.log(step, loss=float(step))
    resumed.close()
    if sinks == ["csv"]:
        steps = [int(r["step"]) for r in _rows(path)]
    else:
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(9))


def test_tracker_sinks_that_cannot_start_fail_at_construction_with_the_fix(
    tmp_path: Path, monkeypatch
) -> None:
    import types

    def no_key(**kwargs):
        raise RuntimeError("No API key configured")

    def no_store(**kwargs):
        raise RuntimeError("unsupported URI 'sqlite:///mlflow.db'")

    fakes = {
        "wandb": types.SimpleNamespace(init=no_key),
        "mlflow": types.SimpleNamespace(MlflowClient=no_store),
        "mlflow.entities": types.SimpleNamespace(),
    }
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: fakes.get(name) or real(name, *a))
    with pytest.raises(
        SpeedupsError, match=r"wandb.init failed \(RuntimeError: No API key.*WANDB_MODE=offline"
    ):
        MetricLogger(tmp_path, sinks="wandb")
    with pytest.raises(SpeedupsError, match=r"could not open its tracking store.*MLFLOW_TRACKING_URI"):
        MetricLogger(sinks="mlflow")

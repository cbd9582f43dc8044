"""A metric row, once logged, is never lost, doubled or corrupted: one writer per file, earlier runs kept,
exact resume at a mid-window checkpoint, a bad log_dir refused when the logger is made (and a logger that
fails when made leaves nothing it made), one line ending."""

from __future__ import annotations

import contextlib
import copy
import csv
import gc
import importlib
import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from speedups import MetricLogger, SpeedupsError, SpeedupsWarning, accumulate
from speedups.metrics.sinks import Sink
from tests._dist import ROOT


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# ------------------------------------------------------------------------------------ one writer per file
@pytest.mark.parametrize("sinks", ["csv", "jsonl", ["csv", "jsonl"]])
def test_a_second_logger_on_the_same_files_is_refused_when_made(tmp_path: Path, sinks) -> None:
    first = MetricLogger(tmp_path, sinks=sinks)
    first.log(0, loss=1.0)
    first.flush()
    with pytest.raises(SpeedupsError, match=r"metrics\.(csv|jsonl)' is taken: another MetricLogger of this"):
        MetricLogger(tmp_path, sinks=sinks)
    with pytest.raises(SpeedupsError, match=r"close the first.*MetricLogger\('.*eval'\)"):
        MetricLogger(tmp_path, sinks=["jsonl", "csv"])
    first.log(1, loss=2.0)  # the first logger's rows are whole: the refused one touched nothing
    first.close()
    if "csv" in sinks:
        assert _rows(tmp_path / "metrics.csv") == [{"step": "0", "loss": "1.0"}, {"step": "1", "loss": "2.0"}]
    with MetricLogger(tmp_path / "eval", sinks="csv") as evaluation:  # its own directory: fine
        evaluation.log(0, val=0.5)
    assert sorted(p.name for p in tmp_path.iterdir() if "lock" in p.name) == []  # released at close


def test_a_refused_logger_releases_what_it_took(tmp_path: Path) -> None:
    held = MetricLogger(tmp_path, sinks="jsonl")
    with pytest.raises(SpeedupsError, match=r"metrics\.jsonl' is taken"):
        MetricLogger(tmp_path, sinks=["csv", "jsonl"])  # took metrics.csv, then found metrics.jsonl taken
    with MetricLogger(tmp_path, sinks="csv") as alone:  # metrics.csv was let go
        alone.log(0, a=1.0)
    held.close()


def test_a_logger_that_fails_when_made_leaves_nothing_it_made(tmp_path: Path, monkeypatch) -> None:
    finished: list[str] = []

    class Run:  # a W&B run that started
        def finish(self) -> None:
            finished.append("run")

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
    new = tmp_path / "runs" / "exp1"
    with pytest.raises(SpeedupsError, match=r"wandb\.init failed \(RuntimeError: No API key"):
        MetricLogger(new, sinks=["csv", "wandb"])  # the W&B sink made log_dir, then failed
    assert list(tmp_path.iterdir()) == []  # neither exp1 nor runs: it made both
    with pytest.raises(SpeedupsError, match=r"wandb\.init failed"):
        MetricLogger(tmp_path, sinks="wandb")
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []  # a directory that was there stays

    fakes["wandb"] = types.SimpleNamespace(init=lambda **kwargs: Run())
    with pytest.raises(SpeedupsError, match=r"could not open its tracking store"):
        MetricLogger(new, sinks=["csv", "wandb", "mlflow"])  # W&B started, then MLflow failed
    assert finished == ["run"] and list(tmp_path.iterdir()) == []  # the run it started is finished

    class Taken(Sink):
        name = "taken"

        def claim(self) -> None:
            raise SpeedupsError("held elsewhere")

    with pytest.raises(SpeedupsError, match="held elsewhere"):
        MetricLogger(new, sinks=["csv", Taken()])  # metrics.csv locked, then the next claim failed
    assert list(tmp_path.iterdir()) == []  # the lock let go, its file and the folders removed
    with MetricLogger(new, sinks="csv") as logger:
        logger.log(0, a=1.0)
    assert sorted(p.name for p in new.iterdir()) == ["metrics.csv"]


def test_a_closed_or_collected_logger_leaves_the_directory_free(tmp_path: Path) -> None:
    with MetricLogger(tmp_path) as first:
        first.log(0, a=1.0)
    second = MetricLogger(tmp_path)  # a closed logger's directory can be used again
    second.log(0, a=2.0)
    del second  # a notebook: the old logger dropped without close()
    gc.collect()
    with (
        pytest.warns(SpeedupsWarning, match="held the rows of an earlier run"),
        MetricLogger(tmp_path) as third,
    ):
        third.log(0, a=3.0)


def test_another_process_holding_the_file_is_named_and_a_killed_one_frees_it(tmp_path: Path) -> None:
    holder = subprocess.Popen(  # holds until killed (or its stdin closes): no sleep to outlast
        [sys.executable, "-c", "import sys\nfrom speedups import MetricLogger\n"
         "logger = MetricLogger(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()", str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(SpeedupsError, match=rf"writes it \(process {holder.pid} holds it\)"):
            MetricLogger(tmp_path)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        holder.wait()
    assert (tmp_path / "metrics.csv.lock").exists()
    with MetricLogger(tmp_path) as logger:  # the stale file holds no lock: taken
        logger.log(0, a=1.0)
    assert _rows(tmp_path / "metrics.csv") == [{"step": "0", "a": "1.0"}]


def test_a_process_that_exits_without_close_removes_its_lock(tmp_path: Path) -> None:
    out = _python(
        """
        import sys
        from speedups import MetricLogger
        logger = MetricLogger(sys.argv[1])
        logger.log(0, a=1.0)
        logger.flush()
        """,
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


# ------------------------------------------------------------------------------ earlier runs are kept
def test_a_new_run_in_a_used_directory_keeps_the_earlier_rows_aside(tmp_path: Path) -> None:
    for run in range(3):
        said = pytest.warns(SpeedupsWarning, match=r"earlier run; they are kept in '.*metrics\.earlier-")
        with said if run else contextlib.nullcontext(), MetricLogger(tmp_path, sinks=["csv", "jsonl"]) as lg:
            for step in range(100 if run == 0 else 3):
                lg.log(step, loss=float(run * 1000 + step))
    assert [float(r["loss"]) for r in _rows(tmp_path / "metrics.csv")] == [2000.0, 2001.0, 2002.0]
    first = _rows(tmp_path / "metrics.earlier-1.csv")  # every row of the first run, in its own file
    assert [float(r["loss"]) for r in first] == [float(step) for step in range(100)]
    assert [float(r["loss"]) for r in _rows(tmp_path / "metrics.earlier-2.csv")] == [1000.0, 1001.0, 1002.0]
    lines = (tmp_path / "metrics.earlier-1.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [float(step) for step in range(100)]


def test_a_logger_that_writes_nothing_moves_nothing(tmp_path: Path) -> None:
    with MetricLogger(tmp_path) as logger:
        logger.log(0, a=1.0)
    MetricLogger(tmp_path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


# ------------------------------------------------------------------------- exact resume, mid-window too
def _run(folder: Path, mode: str, state: dict | None = None) -> dict | None:
    """The nc05 loop: accumulate(3), one row per micro-step at num_updates, a checkpoint after the 4th call
    (mid-window), killed after the 5th (``mode="kill"``), or resumed from ``state``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = accumulate(3, opt)(lambda x: model(x).pow(2).mean())
    logger = MetricLogger(folder, sinks=["csv", "jsonl"], every=1)
    train_step.on_update(logger.log_update)
    data = [torch.randn(4, 2, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    saved, start = None, 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        train_step.load_state_dict(state["step"])
        logger.load_state_dict(state["logger"])
        start = state["i"]
    for i in range(start, 12):
        train_step(data[i])
        logger.log(train_step.num_updates, micro_loss=float(i))
        if i + 1 == 4 and state is None:
            saved = copy.deepcopy(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "step": train_step.state_dict(),
                    "logger": logger.state_dict(),
                    "i": i + 1,
                }
            )
        if mode == "kill" and i + 1 == 5:
            logger.close()  # the rows so far are in the files; the process would die here
            return saved
    logger.close()
    return saved


def test_a_row_logged_after_a_mid_window_save_is_not_doubled_by_the_resume(tmp_path: Path) -> None:
    _run(tmp_path / "full", "full")
    state = _run(tmp_path / "cut", "kill")
    assert state is not None and state["logger"] == {"step": 1, "rows_at_step": 3}  # update 1, calls 2 and 3
    _run(tmp_path / "cut", "resume", state)
    for name in ("metrics.csv", "metrics.jsonl"):
        full = (tmp_path / "full" / name).read_text()
        assert (tmp_path / "cut" / name).read_text() == full  # byte for byte: no row twice, none missing
    steps = [int(r["step"]) for r in _rows(tmp_path / "full" / "metrics.csv") if r["micro_loss"]]
    assert steps == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_a_checkpoint_without_a_row_count_keeps_every_row_at_its_step(tmp_path: Path) -> None:
    with MetricLogger(tmp_path) as logger:
        for step, value in [(0, 1.0), (1, 2.0), (1, 3.0), (2, 4.0)]:
            logger.log(step, a=value)
    resumed = MetricLogger(tmp_path)
    resumed.load_state_dict({"step": 1})  # what state_dict() returned before rows_at_step
    resumed.log(2, a=5.0)
    resumed.close()
    assert [r["a"] for r in _rows(tmp_path / "metrics.csv")] == ["1.0", "2.0", "3.0", "5.0"]
    with pytest.raises(ValueError, match=r"'rows_at_step': int >= 0"):
        MetricLogger(tmp_path / "x").load_state_dict({"step": 1, "rows_at_step": -1})


def test_a_checkpoint_saved_before_any_row_drops_every_row_of_the_killed_run(tmp_path: Path) -> None:
    logger = MetricLogger(tmp_path, sinks=["csv", "jsonl"])
    state = logger.state_dict()  # saved before the first log
    logger.log(0, a=1.0)
    logger.close()  # killed after it wrote step 0
    resumed = MetricLogger(tmp_path, sinks=["csv", "jsonl"])
    resumed.load_state_dict(state)
    resumed.log(0, a=2.0)
    resumed.close()  # no warning, no earlier file: those rows came after the checkpoint
    assert _rows(tmp_path / "metrics.csv") == [{"step": "0", "a": "2.0"}]
    assert [json.loads(line)["a"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]


# -------------------------------------------------------------------------- a bad log_dir, line endings
def test_a_log_dir_that_cannot_be_made_is_refused_when_the_logger_is_made(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "run"
    with pytest.raises(ValueError, match=rf"log_dir='{bad}' cannot be made \(NotADirectoryError"):
        MetricLogger(bad)
    with pytest.raises(ValueError, match=r"cannot be made"):
        MetricLogger(bad, sinks="jsonl", every=1)
    made = tmp_path / "new" / "run"
    MetricLogger(made).close()
    assert made.is_dir()  # made when the logger is, not at the first write
    MetricLogger(bad, enabled=False).close()  # a disabled logger makes nothing


def test_the_csv_ends_every_line_with_lf_only(tmp_path: Path) -> None:
    logger = MetricLogger(tmp_path, every=1)
    for step in range(4):
        logger.log(step, a=float(step), **({"b": 1.0} if step == 2 else {}))  # widened: header rewritten
        if step == 2:
            state = logger.state_dict()
    logger.close()
    resumed = MetricLogger(tmp_path, every=1)
    resumed.load_state_dict(state)  # the kept rows rewritten
    resumed.log(3, a=3.5)
    resumed.close()
    data = (tmp_path / "metrics.csv").read_bytes()
    assert b"\r" not in data and data.count(b"\n") == 5
    assert data.decode().splitlines()[0] == "step,a,b"

"""MetricLogger under 2 processes: every flush path for every count of pending rows, and log_update's loss
(the job's, as one process with the same global batch logs it)."""

from __future__ import annotations

import ast
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import ROOT, WORKERS, free_port, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _line(stdout: str, prefix: str) -> str:
    found = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, stdout
    return found[0][len(prefix) :]


def test_every_flush_path_with_every_count_of_pending_rows_on_two_ranks(tmp_path: Path) -> None:
    out = run_torchrun(WORKERS / "metric_flush_paths.py", [str(tmp_path)], nproc=2, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for r in (0, 1):
        assert ast.literal_eval(_line(out.stdout, f"rank{r} failures=")) == []
    states = dict(item.split("=", 1) for item in _line(out.stdout, "rank0 states=").split(";"))
    assert _line(out.stdout, "rank1 states=") == _line(out.stdout, "rank0 states=")  # every rank agrees
    for mode in ("all", "rank0"):
        for path in ("close", "with", "state_dict", "flush_twice", "automatic"):
            for n in range(8):
                folder = tmp_path / f"{mode}-{path}-{n}"
                steps = n + (-n % 3) if path == "automatic" else n
                if steps == 0:
                    assert list(folder.iterdir()) == []  # nothing logged: no file (and no lock left)
                    continue
                assert sorted(p.name for p in folder.iterdir()) == ["metrics.csv"]
                rows = _rows(folder / "metrics.csv")
                assert [int(row["step"]) for row in rows] == list(range(steps))
                shift = 0.5 if mode == "all" else 0.0  # the mean of ranks 0 and 1, or rank 0's own
                assert [float(row["loss"]) for row in rows] == [step + shift for step in range(steps)]
                if path == "state_dict":
                    want = {"step": n - 1, "rows_at_step": 1} if n else {"step": None, "rows_at_step": 0}
                    name = f"{mode}-{path}-{n}"
                    assert ast.literal_eval(states[name]) == ast.literal_eval(states[name + "/again"]) == want


@pytest.mark.parametrize("mode", ["mean", "items"])
def test_log_update_logs_the_jobs_loss_as_one_process_with_the_global_batch_does(
    tmp_path: Path, mode: str
) -> None:
    one = run_torchrun(WORKERS / "metric_update_loss.py", [str(tmp_path / "one"), mode], nproc=1, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    two = run_torchrun(WORKERS / "metric_update_loss.py", [str(tmp_path / "two"), mode], nproc=2, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    reference = json.loads((tmp_path / "two" / "reference.json").read_text())  # a plain PyTorch loop's
    assert reference == pytest.approx(json.loads((tmp_path / "one" / "reference.json").read_text()))
    assert len(reference) == 6  # two epochs of 3 updates: full windows and a short one
    for run in ("one", "two"):
        for kind in ("default", "all_ranks"):
            rows = [row for row in _rows(tmp_path / run / kind / "metrics.csv") if row["loss"]]
            assert [int(row["step"]) for row in rows] == list(range(1, 7))
            got = [float(row["loss"]) for row in rows]
            assert got == pytest.approx(reference, rel=1e-6, abs=1e-7), (run, kind)
    own = [float(row["loss"]) for row in _rows(tmp_path / "two" / "own.csv")]
    assert max(abs(a - b) for a, b in zip(own, reference, strict=True)) > 1e-3  # rank 0's own loss differs
    for r in (0, 1):  # no wait at log_update: the all-reduces are waited for when their rows are written
        assert _line(two.stdout, f"rank{r} waits_before_flush=") == "0"
        assert int(_line(two.stdout, f"rank{r} all_reduces_issued=")) == 6
    alone = _line(two.stdout, "rank0 alone=")
    assert "the other ranks did not call it" in alone and "rank 0's own loss" in alone
    alone_rows = [float(row["loss"]) for row in _rows(tmp_path / "two" / "alone" / "metrics.csv")]
    assert alone_rows == pytest.approx(own, rel=1e-6)  # rank 0 alone: its own loss, said, and no hang


def test_processes_spawned_before_their_process_group_exists_write_once(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(WORKERS / "metric_spawn_before_init.py"), str(tmp_path), str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert sorted(out.stdout.split()) == ["ok", "ok", "rank0", "rank1"]
    assert [float(row["loss"]) for row in _rows(tmp_path / "metrics.csv")] == [s + 0.5 for s in range(5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]

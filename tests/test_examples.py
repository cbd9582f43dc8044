"""The examples run as a user runs them: as subprocesses, with few epochs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts subprocesses

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_train_digits_trains_and_prints_a_parsable_accuracy() -> None:
    out = run_example("examples/train_digits.py", "--epochs", "2", "--device", "cpu", "--seed", "1")
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=(\d\.\d{4})", last)
    assert match, last
    assert float(match.group(1)) > 0.8  # two epochs on the digits already reach ~0.9
    losses = [float(v) for v in re.findall(r"train_loss=([\d.]+)", out.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_train_digits_with_accumulation_trains_one_epoch() -> None:
    out = run_example(
        "examples/train_digits.py", "--epochs", "1", "--device", "cpu", "--seed", "1", "--accumulate", "2"
    )
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    match = re.fullmatch(r"test_accuracy=(\d\.\d{4})", out.stdout.strip().splitlines()[-1])
    assert match and float(match.group(1)) > 0.5, out.stdout  # one epoch with half the optimizer steps


def test_train_digits_with_auto_micro_batches_trains_one_epoch() -> None:
    # one compute thread in all three (a count timed per run could differ, and float rounding with it)
    args = ("--epochs", "1", "--device", "cpu", "--seed", "1", "--accumulate", "2", "--threads", "1")
    args += ("--micro-batch-size",)
    auto = run_example("examples/train_digits.py", *args, "auto")
    fixed = run_example("examples/train_digits.py", *args, "16")
    plain = run_example("examples/train_digits.py", *args[:-1])
    for out in (auto, fixed, plain):
        assert out.returncode == 0, out.stderr
        assert "Warning" not in out.stderr, out.stderr
    assert "micro_batch_size='auto': whole batches (64 rows) fit so far" in auto.stdout  # no OOM here
    assert "micro_batch_size=16: 16 rows" in fixed.stdout
    accuracy = [
        float(re.fullmatch(r"test_accuracy=(\d\.\d{4})", o.stdout.split()[-1]).group(1))
        for o in (auto, fixed, plain)
    ]
    # the same training: "auto" (whole batches) exactly; 16-row pieces up to the summation order, which one
    # epoch of this small model can turn into a few test images (0.025 seen on torch 2.4)
    assert accuracy[0] == accuracy[2] and abs(accuracy[1] - accuracy[2]) < 0.04, accuracy


def test_train_digits_splits_the_cores_by_timing_and_keeps_a_count_given() -> None:
    common = ("examples/train_digits.py", "--epochs", "1", "--device", "cpu")
    auto, fixed = run_example(*common), run_example(*common, "--threads", "1")
    for out in (auto, fixed):
        assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr
    chosen = re.search(r"tune_loader: num_threads=(\d+) \(was (\d+)\)", auto.stdout)
    assert chosen and 1 <= int(chosen.group(1)) <= int(chosen.group(2)), auto.stdout
    assert re.search(r"tune_loader: num_threads=1 \(was \d+\)", fixed.stdout), fixed.stdout
    bad = run_example(*common, "--threads", "0")
    assert bad.returncode == 2 and "expected 'auto' or an int >= 1, got '0'" in bad.stderr


def test_train_digits_mnist_without_files_explains_how_to_get_them(tmp_path: Path) -> None:
    out = run_example("examples/train_digits.py", "--dataset", "mnist", "--data-root", str(tmp_path))
    assert out.returncode != 0
    assert "--download" in out.stderr and "not found" in out.stderr
    assert not any(tmp_path.iterdir()), "nothing may be downloaded without --download"


def test_train_digits_bad_device_is_a_clear_error() -> None:
    out = run_example("examples/train_digits.py", "--epochs", "1", "--device", "cuda:7")
    assert out.returncode != 0 and "Available here" in out.stderr


def test_loss_tracker_only_example_loss_goes_down() -> None:
    out = run_example("examples/loss_tracker_only.py", "--epochs", "3")
    assert out.returncode == 0, out.stderr
    losses = [float(v) for v in re.findall(r"train_loss=([\d.]+)", out.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0] / 10


def test_train_digits_log_dir_writes_the_metrics_and_their_picture(tmp_path: Path) -> None:
    import csv

    run = tmp_path / "digits"
    out = run_example("examples/train_digits.py", "--epochs", "2", "--device", "cpu", "--log-dir", str(run))
    assert out.returncode == 0, out.stderr
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    updates = [r for r in rows if r["loss"]]
    assert [int(r["step"]) for r in updates] == list(range(1, 47))  # 23 updates an epoch (1437 / 64)
    epochs = [r for r in rows if r["test_accuracy"]]
    assert [int(r["step"]) for r in epochs] == [23, 46]
    printed = re.findall(r"test_accuracy=(\d\.\d{4})", out.stdout)
    assert [f"{float(r['test_accuracy']):.4f}" for r in epochs] == printed[:2]  # the values printed
    assert (run / "curves.png").read_bytes()[
        :4
    ] == b"\x89PNG" and f"curves: {run / 'curves.png'}" in out.stdout

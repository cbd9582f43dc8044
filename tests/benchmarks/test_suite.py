"""The benchmark suite's runner and the profiling benchmark run in quick mode (CI smoke test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._dist import ROOT

pytestmark = pytest.mark.slow  # each test starts subprocesses


def test_suite_runner_quick_mode_runs_profiling_and_writes_results(tmp_path) -> None:
    env = dict(os.environ, SPEEDUPS_BENCH_RESULTS=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "profiling"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ratio to plain loop" in out.stdout and "profile_steps() overhead on the example CNN" in out.stdout
    latest = (tmp_path / "latest.md").read_text()
    assert "## profiling" in latest and "FAILED" not in latest
    assert (tmp_path / "profiling.png").read_bytes()[:4] == b"\x89PNG"


def test_suite_runner_rejects_an_unknown_benchmark() -> None:
    cmd = [sys.executable, "-m", "benchmarks", "--only", "nope"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no such benchmark" in out.stderr


def test_memory_benchmark_quick_mode_prints_its_line_and_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--quick"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"memory: checkpointing saves \d+% of activation bytes at \d+\.\d\dx time; plan "
                     r"\d+\.\d\dx of the best single lever", out.stdout), out.stdout  # fmt: skip
    for row in (
        "| plain",
        "| every block checkpointed",
        "| micro-batches only",
        "| checkpointing only",
        "| plan (",
    ):
        assert row in out.stdout


def test_overhead_benchmark_quick_mode_prints_every_wrapper_and_its_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--quick"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    line = (
        r"overhead: @accumulate [+-]\d+\.\d us per call \(\d\.\d{3}x of the hand loop; floor \d\.\d{3}x\), "
        r"mixed_precision [+-]\d+\.\d us, LossTracker.update [+-]\d+\.\d us, "
        r"MetricLogger.log [+-]\d+\.\d us, RunDirectory.after_step [+-]\d+\.\d us, "
        r"StopOnSignal.requested [+-]\d+\.\d us"
    )
    assert re.search(line, out.stdout), out.stdout
    for row in ("| @accumulate | hand loop |", "| floor | hand loop |", "| mixed_precision | autocast |"):
        assert row in out.stdout


def test_compile_benchmark_quick_mode_prints_its_line_and_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile", "--quick", "--backend", "aot_eager"], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    line = r"compile: blocks compile \d+\.\dx faster than the whole model; step \d+\.\d\dx of the whole model"
    assert re.search(line, out.stdout), out.stdout
    assert "| whole |" in out.stdout and "| blocks |" in out.stdout


@pytest.mark.distributed
def test_checkpointing_benchmark_quick_mode_prints_both_lines() -> None:
    """The file save and the FSDP2 directory save (2 gloo processes under torchrun), blocking and in the
    background: each prints its ratio line (no bound here: timings are the benchmark's, not a test's)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkpointing", "--quick"], cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(
        r"checkpointing: background save stalls the loop \d+\.\d\dx of a synchronous save", out.stdout
    ), out.stdout
    assert re.search(
        r"checkpointing: FSDP2 background save stalls the loop \d+\.\d\dx of a blocking one", out.stdout
    ), out.stdout

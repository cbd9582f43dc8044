"""Run a benchmark module in quick mode, as a user runs it (``python -m benchmarks.<topic> --quick``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quick(topic: str, *args: str, timeout: float = 180, results: Path | None = None) -> str:
    """Run ``python -m benchmarks.<topic> --quick [args]`` from the repository root; return its stdout.

    Its results and chart go to ``results`` (``SPEEDUPS_BENCH_RESULTS``; a temporary folder when None),
    never over the committed results. Asserts that it exits 0, showing its output if not.
    """
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{topic}", "--quick", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": str(ROOT), "SPEEDUPS_BENCH_RESULTS": str(results or scratch)},
        )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout

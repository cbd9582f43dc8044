"""Run a benchmark module in quick mode, as a user runs it (``python -m benchmarks.<topic> --quick``)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_quick(topic: str, timeout: float = 180) -> str:
    """Run ``python -m benchmarks.<topic> --quick`` from the repository root; return its stdout.

    Its chart goes to a temporary folder (``SPEEDUPS_BENCH_RESULTS``), never over the committed results.
    """
    with tempfile.TemporaryDirectory() as results:
        out = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{topic}", "--quick"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONPATH": str(ROOT), "SPEEDUPS_BENCH_RESULTS": results},
        )
    assert out.returncode == 0, out.stderr
    return out.stdout

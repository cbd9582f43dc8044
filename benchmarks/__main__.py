"""Run the whole benchmark suite with one command and keep the latest results.

    python -m benchmarks             # every benchmark, full size (minutes)
    python -m benchmarks --quick     # every benchmark in smoke mode
    python -m benchmarks --only accumulate precision

Each benchmark is a module ``benchmarks/<topic>.py``, run as ``python -m benchmarks.<topic>`` in its own
process (so thread settings and process groups never leak between them). Their output, ratios measured in
the same run against the plain loop, is printed and written to ``benchmarks/results/latest.md``; their
charts go to ``benchmarks/results/<topic>.png``. ``SPEEDUPS_BENCH_RESULTS=DIR`` writes both elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks._timing import RESULTS

HERE = Path(__file__).resolve().parent


def topics() -> list[str]:
    """Every benchmark module's name, sorted."""
    return sorted(p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the speedups benchmark suite.")
    parser.add_argument("--quick", action="store_true", help="smoke mode: small sizes, few rounds")
    parser.add_argument("--only", nargs="+", metavar="TOPIC", help=f"a subset of {topics()}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    args = parser.parse_args(argv)
    chosen = args.only or topics()
    unknown = sorted(set(chosen) - set(topics()))
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: no such benchmark. Available: {', '.join(topics())}.")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (
        f"# Benchmark results ({'quick' if args.quick else 'full'} mode)\n\n"
        f"{stamp}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}\n"
    )
    sections, failed = [header], []
    for topic in chosen:
        cmd = [sys.executable, "-m", f"benchmarks.{topic}", *(["--quick"] if args.quick else [])]
        print(f"== {topic}: {' '.join(cmd[1:])}", flush=True)
        try:
            out = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=args.timeout)
            text, ok = out.stdout + (out.stderr if out.returncode else ""), out.returncode == 0
        except subprocess.TimeoutExpired:
            text, ok = f"timed out after {args.timeout:.0f} s", False
        print(text, flush=True)
        if not ok:
            failed.append(topic)
        sections.append(f"## {topic}{'' if ok else ' (FAILED)'}\n\n```\n{text.strip()}\n```\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    latest = RESULTS / "latest.md"
    if args.only and latest.exists():  # keep the other topics' sections of the last run
        kept = [f"## {part}" for part in latest.read_text().split("\n## ")[1:]]
        kept = [k for k in kept if k.split()[1] not in chosen]
        sections = [sections[0], *sorted([*kept, *sections[1:]])]
    latest.write_text("\n".join(sections))
    print(f"results: {RESULTS / 'latest.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

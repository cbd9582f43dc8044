"""Shared timing helpers for the benchmarks: interleaved rounds, medians, ratio tables, PNG charts.

Every benchmark compares variants *in the same run*, round-robin, so that a noisy shared machine slows all
variants alike; results are medians over rounds, reported as ratios to a named baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

# Where charts and the suite's latest.md go; tests point it at a temporary folder.
RESULTS = Path(os.environ.get("SPEEDUPS_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def shown(path: Path) -> str:
    """``path`` as printed into results: relative to the repository root when inside it (no machine paths)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def tiny_mlp_run(
    argv: list[str] | None, doc: str, steps: int, unit: str, rounds: int = 9
) -> tuple[int, int, list[Any], bool]:
    """The tiny-MLP benchmarks' command line and data: ``(steps, rounds, batches, quick)``.

    ``--quick`` (40 steps, 2 rounds), ``--steps``, ``--rounds`` (default ``rounds``); one compute thread;
    ``steps`` batches of 32 rows of 64 features and a label of 10 classes, the same in every run.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds: a smoke run")
    parser.add_argument("--steps", type=int, default=steps, help=f"{unit} per timed pass")
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args(argv)
    steps, rounds = (40, 2) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(steps)
    ]
    return steps, rounds, batches, args.quick


def installed_peers(peers: Sequence[tuple[str, str, T]]) -> tuple[list[tuple[str, T]], list[str]]:
    """Split ``(name, module, maker)`` peers into those whose module is installed, as ``(name, maker)``,
    and the names of the others, as ``"<name> (not installed)"`` (the peers are optional extras)."""
    found, skipped = [], []
    for name, module, make in peers:
        if importlib.util.find_spec(module) is None:
            skipped.append(f"{name} (not installed)")
        else:
            found.append((name, make))
    return found, skipped


def compare(
    variants: Mapping[str, Callable[[], object]], *, rounds: int = 7, warmup: int = 1
) -> dict[str, float]:
    """Time each variant (a callable doing one unit of work) ``rounds`` times, interleaved.

    Returns:
        Median seconds per call for each variant name.
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def ratio_table(title: str, seconds: Mapping[str, float], baseline: str, unit: str = "s") -> str:
    """Format a table of times and their ratio to ``baseline`` (lower is faster)."""
    base = seconds[baseline]
    width = max(len(n) for n in seconds)
    lines = [title, f"{'variant':<{width}}  {'time':>12}  ratio to {baseline}"]
    for name, value in seconds.items():
        lines.append(f"{name:<{width}}  {value:>10.4g} {unit}  {value / base:>6.3f}x")
    return "\n".join(lines)


def save_chart(path: Path | str, title: str, ratios: Mapping[str, float], *, ylabel: str = "ratio") -> str:
    """Write a bar chart of ``ratios`` to a PNG (needs matplotlib); return its path, as :func:`shown`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.bar(list(ratios), list(ratios.values()), color="#4c72b0")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return shown(path)


def write_section(topic: str, text: str) -> Path:
    """Make ``text`` the ``## topic`` section of ``RESULTS/latest.md``, as ``python -m benchmarks`` does.

    The other topics' sections are kept (sorted by name, like the suite's runner); the file is created with
    a plain header if missing. Returns the file's path.
    """
    latest = RESULTS / "latest.md"
    old = latest.read_text() if latest.exists() else "# Benchmark results\n"
    header, *parts = old.split("\n## ")
    kept = [f"## {p}" for p in parts if p.split(None, 1)[0] != topic]
    section = f"## {topic}\n\n```\n{text.strip()}\n```\n"
    latest.parent.mkdir(parents=True, exist_ok=True)
    latest.write_text("\n".join([header.rstrip("\n") + "\n", *sorted([*kept, section])]))
    return latest

"""Draw where a profiled run's time went, on a figure of its own (matplotlib's Agg canvas, no pyplot).

No global state is touched: the process's matplotlib backend and pyplot's figures stay as they were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from speedups._helpers.figures import agg_figure

__all__ = ["draw_steps"]


class _Step(Protocol):
    data_s: float
    step_s: float
    sampled: bool


def draw_steps(path: Path, steps: Sequence[_Step], data_fraction: float) -> Path:
    """Draw each step's data wait and step time as stacked bars into a PNG at ``path``; return ``path``.

    Sampled steps (slower: their syncs were counted) are marked and cut at 1.5x the tallest plain step.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'speedups[examples]'``).
    """
    fig = agg_figure((8, 3.5), needed_by="profile_steps().plot()")
    indices = range(len(steps))
    data_ms = [r.data_s * 1e3 for r in steps]
    step_ms = [r.step_s * 1e3 for r in steps]
    ax = fig.subplots()
    ax.bar(indices, data_ms, color="#dd8452", label="waiting for data")
    ax.bar(indices, step_ms, bottom=data_ms, color="#4c72b0", label="in the step")
    sampled = [i for i, r in enumerate(steps) if r.sampled]
    plain_tops = [d + t for d, t, r in zip(data_ms, step_ms, steps, strict=True) if not r.sampled]
    top = 1.5 * max(plain_tops) if plain_tops else None
    if top:  # sampled steps can be far slower (the first one warms up the counter): keep them in view
        ax.set_ylim(0, top)
    if sampled:
        tops = [min(data_ms[i] + step_ms[i], top or math.inf) for i in sampled]
        ax.scatter(sampled, tops, marker="v", color="black", s=12, label="syncs counted (slower, cut)")
    ax.set_xlabel("step")
    ax.set_ylabel("milliseconds")
    ax.set_title(
        f"where the time goes: {data_fraction:.0%} waiting for data, {1 - data_fraction:.0%} in the step"
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path

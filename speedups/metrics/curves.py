"""A run's logged curves as a PNG: :func:`plot_metrics` (the command line is ``python -m speedups.plot``).

Reads what :class:`~speedups.MetricLogger` wrote (``metrics.csv``, else ``metrics.jsonl``) and draws one
panel per metric against the step, on a matplotlib figure of its own (the Agg canvas: the process's backend
and pyplot's figures are never touched).
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from speedups._helpers.figures import agg_figure

__all__ = ["plot_metrics", "read_metrics"]


def read_metrics(source: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """The logged curves: ``{metric: [(step, value), ...]}`` from a run directory, a CSV or a JSON-lines file.

    Raises:
        FileNotFoundError: no such file, or a directory without ``metrics.csv`` or ``metrics.jsonl``.
    """
    path = Path(source)
    if path.is_dir():
        for name in ("metrics.csv", "metrics.jsonl"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise FileNotFoundError(
                f"plot_metrics({str(source)!r}): the directory holds no metrics.csv or metrics.jsonl. Pass "
                f"the log_dir a MetricLogger wrote to, or the file itself."
            )
    if not path.is_file():
        raise FileNotFoundError(f"plot_metrics({str(source)!r}): no such file or directory.")
    curves: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        rows = (
            [json.loads(line) for line in f if line.strip()] if path.suffix == ".jsonl" else csv.DictReader(f)
        )
        for row in rows:
            step = int(row["step"])
            for name, value in row.items():
                if name != "step" and value not in ("", None):
                    curves.setdefault(name, []).append((step, float(value)))
    return curves


def plot_metrics(source: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Path:
    """Draw every logged metric of ``source`` (one panel each, x = step) into a PNG; return its path.

    Args:
        source: a run directory (``log_dir`` of a :class:`~speedups.MetricLogger`), a ``metrics.csv`` or a
            ``metrics.jsonl``.
        output: the PNG to write: a path ending in ``.png``, a name without one (``.png`` is added, also
            after a dot in the name: ``run-v1.0`` writes ``run-v1.0.png``), or a directory (existing, or
            written with a trailing ``/``: ``curves.png`` in it); None: ``curves.png`` beside the metrics.

    Returns:
        The path of the file written.

    Raises:
        FileNotFoundError: nothing to read at ``source``.
        TypeError: ``output`` is not a path.
        ValueError: the file holds no metric; ``output`` is empty or names another image format.
        ImportError: matplotlib is not installed.
    """
    source_path = Path(source)
    if output is not None:
        out = _png_path(source, output)
    else:
        out = (source_path if source_path.is_dir() else source_path.parent) / "curves.png"
    curves = read_metrics(source)
    if not curves:
        raise ValueError(f"plot_metrics({str(source)!r}): no metric in it; log some with MetricLogger.log().")
    columns = min(3, len(curves))
    rows = math.ceil(len(curves) / columns)
    fig = agg_figure((4.0 * columns, 2.8 * rows), needed_by="plot_metrics()")
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (name, points) in zip(axes.flat, sorted(curves.items()), strict=False):
        marker = "o" if len(points) < 30 else None  # a metric logged once (per epoch, say) shows as a point
        ax.plot(
            [s for s, _ in points],
            [v for _, v in points],
            color="#4c72b0",
            linewidth=1.2,
            marker=marker,
            markersize=3,
        )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(curves) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


_OTHER_FORMATS = {
    ".eps", ".gif", ".jpeg", ".jpg", ".pdf", ".pgf", ".ps", ".raw", ".rgba", ".svg", ".svgz", ".tif", ".tiff",
    ".webp", ".bmp",
}  # fmt: skip


def _png_path(source: str | os.PathLike[str], output: str | os.PathLike[str]) -> Path:
    """The file ``output`` names: itself (``.png``), with ``.png`` added (no suffix), or ``curves.png`` in
    it (a directory, or a name ending in a separator).

    Raises:
        TypeError: ``output`` is not a path.
        ValueError: an empty path, or another image format's suffix (``.pdf``, ``.jpg``, ...).
    """
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(
            f"plot_metrics({str(source)!r}, output={output!r}): expected a path (str or pathlib.Path) of the "
            f"PNG to write, got {type(output).__name__}. Write output='curves.png'."
        )
    text = os.fspath(output)
    if not text:
        raise ValueError(
            f"plot_metrics({str(source)!r}, output=''): an empty path. Name the PNG (output='curves.png') or "
            f"pass output=None for curves.png beside the metrics."
        )
    out = Path(text)
    if out.is_dir() or text.endswith((os.sep, "/")):
        return out / "curves.png"
    if out.suffix.lower() == ".png":
        return out
    if out.suffix.lower() not in _OTHER_FORMATS:  # no suffix, or a dot in a name ("run-v1.0")
        return out.with_name(out.name + ".png")
    raise ValueError(
        f"plot_metrics({str(source)!r}, output={text!r}): plot_metrics writes a PNG; {out.suffix!r} is "
        f"another format. Write output={str(out.with_name(out.name + '.png'))!r}."
    )

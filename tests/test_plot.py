"""plot_metrics / python -m speedups.plot: the logged curves as a PNG, on a figure of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speedups import MetricLogger, plot_metrics
from speedups.metrics.curves import read_metrics
from tests._dist import ROOT

matplotlib = pytest.importorskip("matplotlib")


def _run(tmp_path: Path, sinks: str = "csv") -> Path:
    with MetricLogger(tmp_path, sinks=sinks) as logger:
        for step in range(5):
            logger.log(step, loss=torch.tensor(1.0 / (step + 1)), lr=0.1)
        logger.log(4, accuracy=0.9)
    return tmp_path


@pytest.mark.parametrize("sinks", ["csv", "jsonl"])
def test_the_curves_are_read_back_and_drawn_one_panel_per_metric(tmp_path: Path, sinks: str) -> None:
    run = _run(tmp_path, sinks)
    curves = read_metrics(run)
    assert sorted(curves) == ["accuracy", "loss", "lr"]
    assert curves["loss"] == [(s, pytest.approx(1.0 / (s + 1))) for s in range(5)]
    assert curves["accuracy"] == [(4, 0.9)]
    backend = matplotlib.get_backend()
    png = plot_metrics(run)
    assert png == run / "curves.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.get_backend() == backend  # the user's backend was never switched
    from PIL import Image  # matplotlib's own dependency

    with Image.open(png) as image:
        assert image.size == (1200, 280)  # three panels side by side, 4 x 2.8 inches at 100 dpi


def test_missing_or_empty_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds no metrics\.csv or metrics\.jsonl"):
        plot_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        plot_metrics(tmp_path / "nope.csv")
    (tmp_path / "metrics.csv").write_text("step\n")
    with pytest.raises(ValueError, match="no metric in it"):
        plot_metrics(tmp_path)


@pytest.mark.slow
def test_the_command_line_draws_to_the_file_given(tmp_path: Path) -> None:
    run = _run(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "speedups.plot", str(run / "metrics.csv"), "-o", str(tmp_path / "c.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip() == str(tmp_path / "c.png") and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    )
    assert "Warning" not in out.stderr, (
        out.stderr
    )  # runpy's "found in sys.modules" warning: not imported twice


def test_a_metric_logged_once_shows_as_a_point(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    with MetricLogger(tmp_path) as logger:
        for step in range(5):
            logger.log(step, loss=1.0 / (step + 1))
        logger.log(4, accuracy=0.9)  # once, per epoch
    drawn: list = []
    real = Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.extend(line for ax in fig.axes for line in ax.get_lines())
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_metrics(tmp_path)
    accuracy = next(line for line in drawn if list(line.get_xdata()) == [4])
    assert accuracy.get_marker() == "o"


@pytest.mark.parametrize(
    ("output", "written"),
    [
        ("curves", "curves.png"),  # no suffix: .png added (matplotlib adds it too, silently)
        ("out/run.v2", "out/run.v2.png"),  # a dot in the name, not an image format: .png added
        ("out/run.pdf", None),  # another image format: refused below
        ("figs", "figs/curves.png"),  # an existing directory: curves.png in it
        ("new/", "new/curves.png"),  # a trailing separator: a directory, made
        ("a/b.PNG", "a/b.PNG"),
    ],
)
def test_the_path_returned_is_the_file_written(tmp_path: Path, output: str, written: str | None) -> None:
    run = _run(tmp_path / "run")
    (tmp_path / "figs").mkdir()
    before = {p for p in tmp_path.rglob("*")}
    if written is None:
        with pytest.raises(ValueError, match=r"run\.pdf'\): plot_metrics writes a PNG.*run\.pdf\.png'"):
            plot_metrics(run, output=str(tmp_path / output))
        assert {p for p in tmp_path.rglob("*")} == before  # refused before anything was drawn
        return
    png = plot_metrics(run, output=str(tmp_path / output) + ("/" if output.endswith("/") else ""))
    assert png == tmp_path / written and png.read_bytes()[:4] == b"\x89PNG"
    assert {p for p in tmp_path.rglob("*") if p.is_file()} - before == {png}  # that file, and only it


def test_an_output_that_is_no_path_or_empty_is_refused_naming_it(tmp_path: Path) -> None:
    run = _run(tmp_path / "run")
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(TypeError, match=r"output=3\): expected a path .*output='curves.png'"):
        plot_metrics(run, output=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"output=''\): an empty path"):
        plot_metrics(run, output="")
    assert {p for p in tmp_path.rglob("*")} == before

"""The end-to-end benchmark in quick mode (its output's form, not its timings), and its results section."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests._dist import ROOT

LAST_LINE = re.compile(
    r"end_to_end: speedups (\d+\.\d\d)x faster than before, (\d+\.\d\d)x of expert, "
    r"accelerate (\d+\.\d\dx|n/a), fabric (\d+\.\d\dx|n/a)"
)


@pytest.mark.slow  # a subprocess that trains five loops (about 20 s of CPU)
def test_quick_run_prints_every_row_and_the_headline_last(tmp_path) -> None:
    env = dict(os.environ, SPEEDUPS_BENCH_RESULTS=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.end_to_end", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    for row in ["before", "after", "expert", "accelerate", "fabric"]:
        # each row is timed, or says why it could not run
        assert any(re.match(rf"{row} +\d+\.\d\d s", line) for line in lines) or any(
            line.startswith(f"{row}: skipped: ") for line in lines
        ), (row, out.stdout)
    before = next(line for line in lines if line.startswith("before "))
    assert "1.00x" in before.split("s", 1)[1]  # before is the reference of its own ratio
    latest = (tmp_path / "latest.md").read_text()
    assert "## end_to_end\n\n```\n" in latest and lines[-1] in latest
    assert (tmp_path / "end_to_end.png").read_bytes()[:4] == b"\x89PNG"


def test_write_section_replaces_its_own_topic_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    from benchmarks import _timing

    monkeypatch.setattr(_timing, "RESULTS", tmp_path)
    (tmp_path / "latest.md").write_text(
        "# Benchmark results (full mode)\n\nstamp\n\n## accumulate\n\n```\nA\n```\n\n"
        "## end_to_end\n\n```\nold\n```\n\n## profiling\n\n```\nP\n```\n"
    )
    _timing.write_section("end_to_end", "new\nlines")
    text = (tmp_path / "latest.md").read_text()
    assert text.startswith("# Benchmark results (full mode)\n\nstamp\n")
    assert "old" not in text and "## end_to_end\n\n```\nnew\nlines\n```\n" in text
    assert text.index("## accumulate") < text.index("## end_to_end") < text.index("## profiling")
    assert "```\nA\n```" in text and "```\nP\n```" in text
    _timing.write_section("sharding", "S")  # a new topic joins in name order
    assert (tmp_path / "latest.md").read_text().rstrip().endswith("## sharding\n\n```\nS\n```")

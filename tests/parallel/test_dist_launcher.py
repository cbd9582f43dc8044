"""The multi-process launch helpers themselves work: one node with 2 processes, and two nodes."""

from __future__ import annotations

import re

import pytest

from tests._dist import WORKERS, run_torchrun, run_two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
# The processes share one stdout, so lines of two ranks can run together: find the records, not lines.
LINE = r"rank=\d+ local_rank=\d+ world=\d+ sum=[\d.]+"


def test_single_node_two_processes_all_reduce() -> None:
    out = run_torchrun(WORKERS / "allreduce_smoke.py", nproc=2, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(re.findall(LINE, out.stdout)) == [
        "rank=0 local_rank=0 world=2 sum=1.0",
        "rank=1 local_rank=1 world=2 sum=1.0",
    ]


def test_two_nodes_on_localhost_all_reduce() -> None:
    results = run_two_nodes(WORKERS / "allreduce_smoke.py", timeout=120)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    lines = sorted(line for r in results for line in re.findall(LINE, r.stdout))
    assert lines == ["rank=0 local_rank=0 world=2 sum=1.0", "rank=1 local_rank=0 world=2 sum=1.0"]

"""FSDP2 long runs at DDP's level: a checkpoint anywhere in a window, background saves, another number of
processes, a stop signal mid-window, each resumed bit for bit (or within the tolerance a changed reduction
order allows) against the uninterrupted run computed in the same test.

The 2-process runs are tests/workers/fsdp2_*.py under torchrun with gloo on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import FSDP2_REASON, HAS_FSDP2, WORKERS, run_torchrun

pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not HAS_FSDP2, reason=FSDP2_REASON),
]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _distance(got: dict, ref: dict) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got["weights"], ref["weights"], strict=True))


def _unequal_parts(got: dict, ref: dict) -> list[str]:
    return [key for key in ref if not _equal(got[key], ref[key])]


def test_an_fsdp2_run_resumed_after_every_micro_step_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Checkpoints after each of the 10 micro-steps of epoch 0 (@accumulate(4): windows of 4, 4 and a
    flushed 2), mid-window ones included, each resumed in new processes: weights, batch statistics, optimizer
    state, counters and trackers torch.equal to the uninterrupted run's on every rank."""
    script = WORKERS / "fsdp2_resume_window.py"
    done = run_torchrun(script, [str(tmp_path), "full"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refs = [torch.load(tmp_path / f"ref-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert refs[0]["updates"] == (20, 6), refs[0]["updates"]  # 3 windows an epoch, the short one applied
    assert not _equal(refs[0]["tracker"], refs[1]["tracker"])  # each rank its own batches and dropout
    assert not _equal(refs[0]["buffers"], refs[1]["buffers"])  # and its own batch statistics
    for rank, ref in enumerate(refs):
        saving = torch.load(tmp_path / f"saving-rank{rank}.pt", weights_only=True)
        assert _unequal_parts(saving, ref) == [], "saving changed the run"
    points = [str(k) for k in range(1, 11)]
    done = run_torchrun(script, [str(tmp_path), "resume", ",".join(points)], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for k in points:
        for rank, ref in enumerate(refs):
            got = torch.load(tmp_path / f"resumed-{k}-rank{rank}.pt", weights_only=True)
            assert _unequal_parts(got, ref) == [], (rank, k, _distance(got, ref))

"""Per-rank state in FSDP2 checkpoint directories (``torch.distributed.checkpoint``): each rank gets its own.

torch.distributed.checkpoint writes one copy of an entry every rank holds, from whichever rank it picks, so
what a rank saved must not depend on which rank wrote it. The 2-process run is
tests/workers/sharded_rank_states.py: each rank's tracker, loader, @accumulate step and RNG states differ,
and after a load every rank must hold what it saved and continue as the uninterrupted run did, bit for bit.
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
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_FSDP2, reason=FSDP2_REASON),
]


def _equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (tensors by torch.equal, with dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same_kind = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return same_kind and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def test_every_rank_gets_its_own_state_back_from_a_sharded_directory(tmp_path: Path) -> None:
    done = run_torchrun(WORKERS / "sharded_rank_states.py", [str(tmp_path)], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for mode in ("once", "twice"):
        got = [torch.load(tmp_path / f"{mode}-rank{r}.pt", weights_only=True) for r in (0, 1)]
        # The ranks' states differ, so a rank given the other's would show.
        for what in ("tracker", "loader"):
            assert not _equal(got[0]["saved"][what], got[1]["saved"][what]), (mode, what)
        assert not _equal(got[0]["uninterrupted"]["draws"], got[1]["uninterrupted"]["draws"]), mode
        for rank, run in enumerate(got):
            where = f"{mode}, rank {rank}"
            # Plain PyTorch: the tracker's mean is the mean of the losses this rank saw (n=2 each).
            mean = sum(run["losses"]) / len(run["losses"])
            assert run["saved"]["tracker"]["sum"] / run["saved"]["tracker"]["count"] == pytest.approx(
                mean, rel=1e-12, abs=0
            ), where
            for what in ("tracker", "step", "loader"):
                assert _equal(run["loaded"][what], run["saved"][what]), (where, what)
            assert run["model_back"], where
            # The RNG states are this rank's: the same draws after the load as right after the save.
            assert _equal(run["resumed"]["draws"], run["uninterrupted"]["draws"]), where
            assert run["resumed"]["losses"] == run["uninterrupted"]["losses"], where  # bit for bit
            assert run["resumed"]["tracker"] == run["uninterrupted"]["tracker"], where
            # Plain values are rank 0's on every rank, as from a checkpoint file rank 0 writes.
            assert run["extra"] == {"calls": 4, "who": 0}, where

"""Resuming on another layout: a checkpoint saved on W processes x accumulate(A) x batch B continues on
W' x A' x B' with the same global batch, mid-epoch and mid-window, and follows the uninterrupted run to float
rounding; what cannot continue exactly is refused with the fix. The runs are tests/_elastic.py (in this
process) and tests/workers/elastic_resume.py (2 processes under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedups import SpeedupsError, SpeedupsWarning
from tests._dist import WORKERS, run_torchrun
from tests._elastic import run

SCRIPT = WORKERS / "elastic_resume.py"
TOL = 1e-5


def _close(got: dict, ref: dict, what: str) -> None:
    for a, b in zip(got["weights"], ref["weights"], strict=True):
        assert (a - b).abs().max().item() < TOL, f"{what}: weights {(a - b).abs().max().item():.2e} away"
    assert got["updates"] == ref["updates"] and got["lr"] == pytest.approx(ref["lr"]), what
    assert got["mean"] == pytest.approx(ref["mean"], rel=1e-5), what


def _torchrun(*args: str) -> None:
    done = run_torchrun(SCRIPT, list(args), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("items", [False, True], ids=["mean", "items"])
def test_one_process_resumes_with_another_batch_and_accumulation(tmp_path: Path, items: bool) -> None:
    ref = run(4, out=tmp_path, save_at=(2, 6, 13, 14), items=items)  # batch 4 x accumulate(4)
    assert ref["updates"] == 6 and ref["micro_steps"] == 24
    same = run(2, batch=8, items=items)  # batch 8 x accumulate(2): the same training, in other pieces
    _close(same, ref, "batch 8 x accumulate(2), uninterrupted")
    for k in (2, 6, 14):  # after a window's first half, mid-window in epoch 0, mid-window in epoch 1
        got = run(2, batch=8, resume=tmp_path / f"k{k}.pt", items=items)
        _close(got, ref, f"saved after micro-step {k} of batch 4, resumed with batch 8")
        assert got["micro_steps"] == 12
    with pytest.raises(
        SpeedupsError,
        match=r"saved 4 samples into its epoch \(all ranks\), which is not a "
        r"whole number of this run's micro-steps \(1 process x batch 8 = 8 samples\)",
    ):
        run(2, batch=8, resume=tmp_path / "k13.pt", items=items)
    with pytest.raises(
        SpeedupsError,
        match=r"saved on 1 process x accumulate\(4\) x batch 4 = 16 samples "
        r"per optimizer step; this run has 1 process x accumulate\(4\) x batch 8 = 32 .*"
        r"Keep 16: decorate the step with accumulate\(2, ...\) here",
    ):
        run(4, batch=8, resume=tmp_path / "k6.pt", items=items)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("batchnorm", [False, True], ids=["per-sample model", "batch norm"])
def test_two_processes_resume_on_one_with_the_accumulation_doubled(tmp_path: Path, batchnorm: bool) -> None:
    """With batch norm the output depends on the whole micro-batch: the resumed run deals the saving
    layout's micro-batches (2 ranks' batches of 4), not its own (one process's batches of 4 of the same
    global order), or the weights leave the run that never stopped (0.5 away here)."""
    flag = ["batchnorm"] if batchnorm else []
    _torchrun(str(tmp_path), "2", "save", "1,3,6,7", *flag)  # 2 x accumulate(2) x 4: 16 samples per step
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert two["updates"] == 6 and two["micro_steps"] == 12
    if not batchnorm:  # the same training on one process (its own micro-batches: the same samples)
        _close(run(4), two, "1 x accumulate(4), uninterrupted")
    for k in (1, 3, 6, 7):  # mid-window, mid-window and mid-epoch, end of epoch 0, mid-window in epoch 1
        with pytest.warns(SpeedupsWarning, match="saved with 2 processes, resumed on 1; each rank keeps its"):
            got = run(4, resume=tmp_path / f"k{k}.pt", batchnorm=batchnorm)
        _close(got, two, f"2 processes saved after micro-step {k}, 1 process resumed")
        assert got["micro_steps"] == 24
    with pytest.raises(
        SpeedupsError,
        match=r"saved on 2 processes x accumulate\(2\) x batch 4 = 16 samples "
        r"per optimizer step; this run has 1 process x accumulate\(2\) x batch 4 = 8 .*"
        r"Keep 16: decorate the step with accumulate\(4, ...\) here",
    ):
        run(2, resume=tmp_path / "k3.pt")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("items", [False, True, "batchnorm"], ids=["mean", "items", "mean, batch norm"])
def test_one_process_resumes_on_two_with_the_accumulation_halved(tmp_path: Path, items: bool | str) -> None:
    batchnorm, items = items == "batchnorm", items is True
    one = run(4, out=tmp_path, save_at=(1, 2, 6, 13), items=items, batchnorm=batchnorm)
    flags = (["items"] if items else []) + (["batchnorm"] if batchnorm else [])
    _torchrun(str(tmp_path), "2", "resume", "1,2,6,13", *flags)
    for k in (2, 6):  # half a window in epoch 0; 8 samples into the second window
        _close(torch.load(tmp_path / f"two-from-{k}.pt", weights_only=True), one, f"resumed after {k}")
    for k in (1, 13):  # 4 samples into a window: not a whole micro-step of 2 processes x batch 4
        refused = (tmp_path / f"refused-{k}.txt").read_text()
        assert "which is not a whole number of this run's micro-steps (2 processes x batch 4 = 8" in refused
        assert not (tmp_path / f"two-from-{k}.pt").exists()


def test_with_a_second_loader_the_one_the_step_trains_on_sets_the_global_batch(tmp_path: Path) -> None:
    from speedups import distributed, fast_loader, load_checkpoint, save_checkpoint
    from tests._elastic import N, build
    from tests._loading_data import Noisy

    def with_test_loader(every: int, batch: int) -> dict:
        state = build(every, batch=batch)
        test = Noisy(N, scale=3)
        state["test_loader"] = distributed(fast_loader(test, 32, num_workers=0))  # sorts before "train"
        return state

    state = with_test_loader(4, 4)
    for x, y in state["step"].epoch(state["loader"]):
        state["step"](x, y)
    save_checkpoint(tmp_path / "c.pt", **state, epoch=1)
    assert torch.load(tmp_path / "c.pt", weights_only=True)["step"]["feed"]["batch_size"] == 4
    load_checkpoint(tmp_path / "c.pt", **with_test_loader(2, 8))  # 16 samples per step: fits
    with pytest.raises(
        SpeedupsError,
        match=r"x batch 4 = 16 samples per optimizer step; this run has 1 "
        r"process x accumulate\(4\) x batch 8 = 32",
    ):
        load_checkpoint(tmp_path / "c.pt", **with_test_loader(4, 8))


def test_the_merged_window_log_counts_the_saved_calls_once_over_the_new_ranks() -> None:
    """Item counts: rank 0 carries the saved window's totals, the others zeros, so the ranks' summed
    (loss * items, items), what MetricLogger.log_update all-reduces, is the job's once, not W times."""
    from speedups.accumulation.state import merged_log as _merged_log

    t = torch.tensor
    logs = [[(t(6.0), 3), (t(2.0), 1)], [(t(4.0), 2), (t(0.0), 0)]]
    merged = [_merged_log(logs, 2, True, rank) for rank in range(3)]
    assert all(len(m) == 2 for m in merged)
    assert sum(float(x) for m in merged for x, _ in m) == 12.0 and sum(n for m in merged for _, n in m) == 6
    means = [_merged_log(logs, 2, False, rank) for rank in range(2)]
    assert all(float(x) == 3.0 and n is None for m in means for x, n in m)  # each rank: the job's mean

"""The resume contract: a run stopped after any micro-step, saved with save_checkpoint and resumed in a fresh
process equals the uninterrupted run bit for bit (weights, optimizer state, loss scale, tracker, LR, and
the batches that follow). The runs are tests/workers/resume_run.py; the in-process pieces of the contract
(RNG draws, lazily built scalers, epoch()) are in tests/test_checkpoint_resume.py."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests._dist import ROOT, WORKERS, _env, run_torchrun

SCRIPT = WORKERS / "resume_run.py"
POINTS = ["1", "2", "3", "4", "5", "end"]  # after each micro-step of epoch 0 (windows 3 + 2), and after it


def _run(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(None), capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _assert_same(got: dict, ref: dict, from_step: int, what: str) -> None:
    for a, b in zip(got["weights"], ref["weights"], strict=True):
        assert torch.equal(a, b), f"{what}: weights differ by {(a - b).abs().max().item():.3e}"
    assert got["optimizer"].keys() == ref["optimizer"].keys(), what
    for index, state in ref["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][index][key], value), f"{what}: optimizer {index}.{key}"
    assert got["scale"] == ref["scale"], what
    assert got["tracker"] == ref["tracker"], what  # history of epoch means and the running totals
    assert got["lr"] == ref["lr"] and got["updates"] == ref["updates"], what
    tail = [(s, i) for s, i in ref["seen"] if s > from_step]
    assert [s for s, _ in got["seen"]] == [s for s, _ in tail], what
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got["seen"], tail, strict=True)), what


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_after_every_micro_step_equals_the_uninterrupted_run(precision: str, tmp_path: Path) -> None:
    _run(precision, str(tmp_path), "full")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    # Saving itself changes nothing: the run that saved after every micro-step is the reference run.
    _assert_same(torch.load(tmp_path / "saving.pt", weights_only=True), ref, 0, "the saving run")
    assert ref["updates"] == (10, 4 if precision != "fp16" else 2)  # fp16: the first 2 windows overflow
    assert ref["scale"] == (2.0**15 if precision == "fp16" else None)
    with ThreadPoolExecutor(2) as pool:  # two fresh processes at a time
        list(pool.map(lambda k: _run(precision, str(tmp_path), "resume", k), POINTS))
    for k in POINTS:
        got = torch.load(tmp_path / f"resumed-{k}.pt", weights_only=True)
        _assert_same(got, ref, 5 if k == "end" else int(k), f"{precision}, resumed after micro-step {k}")


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_under_torchrun_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    done = run_torchrun(SCRIPT, ["fp16", str(tmp_path), "full"], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for k in ("2", "4", "end"):
        done = run_torchrun(SCRIPT, ["fp16", str(tmp_path), "resume", k], timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        ref = torch.load(tmp_path / f"ref-rank{rank}.pt", weights_only=True)
        _assert_same(torch.load(tmp_path / f"saving-rank{rank}.pt", weights_only=True), ref, 0, "saving")
        for k in ("2", "4", "end"):
            got = torch.load(tmp_path / f"resumed-{k}-rank{rank}.pt", weights_only=True)
            _assert_same(got, ref, 5 if k == "end" else int(k), f"rank {rank}, resumed after {k}")

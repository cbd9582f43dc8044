"""Tip 9 with real processes: torchrun (gloo, 127.0.0.1), two "nodes", a crash and resume, the example.

Each job is one launch that checks several things at once (a torchrun start costs a few seconds).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests._bench import run_quick
from tests._dist import HAS_FSDP2, ROOT, WORKERS, _env, run_torchrun, run_two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(300)]

EPOCHS, N, BATCH, WORLD = 2, 48, 4, 2


def _reference() -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Plain PyTorch, one process: each step is one SGD step on the union of the ranks' batches."""
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 5, generator=g)
    y = x @ torch.randn(5, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    ds = TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    history = []
    for epoch in range(EPOCHS):
        per_rank = []
        for r in range(WORLD):
            sampler = DistributedSampler(ds, num_replicas=WORLD, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        losses = []
        for b in range(N // WORLD // BATCH):
            idx = [i for r in range(WORLD) for i in per_rank[r][b * BATCH : (b + 1) * BATCH]]
            loss = F.mse_loss(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        # What LossTracker(all_ranks=True) reads: equal batches, so the mean of the union's losses.
        history.append(sum(losses) / len(losses))
    return model.weight.detach().flatten(), model.bias.detach(), history


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _assert_matches_reference(results: list[dict]) -> None:
    weight, bias, history = _reference()
    for res in results:
        assert res["history"] == pytest.approx(history, rel=1e-6)
        assert res["steps"] == EPOCHS * N // WORLD // BATCH
        torch.testing.assert_close(torch.tensor(res["weight"]), weight, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(res["bias"]), bias, atol=1e-6, rtol=0)


def test_torchrun_two_processes_match_one_process_and_the_checks_hold(tmp_path: Path) -> None:
    out = run_torchrun(WORKERS / "ddp_train.py", [str(tmp_path), "--checks"], timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = _results(tmp_path)
    _assert_matches_reference(results)
    assert results[0]["history"] == results[1]["history"]  # the global mean, read on every rank
    # Sampler rank is the global rank; only global rank 0 is the main process and prints.
    assert [(r["sampler_rank"], r["sampler_replicas"], r["is_main"]) for r in results] == [
        (0, 2, True), (1, 2, False)]  # fmt: skip
    assert out.stdout.count("printed once by rank zero") == 1
    # even=False evaluation: every sample exactly once, unequal counts per rank, no hang.
    seen = [r["val_seen"] for r in results]
    assert sorted(seen[0] + seen[1]) == list(range(11)) and len(seen[0]) != len(seen[1])
    # LossTracker(all_ranks=True): the global weighted mean of (index, n=1) per sample plus rank 1's 100 x 2.
    expected = (sum(range(11)) + 100.0 * 2) / (11 + 2)
    for r in results:
        assert r["val_mean"] == pytest.approx(expected, abs=1e-12)
    # FSDP2 via ddp_wrap(strategy="fsdp") and torch.distributed.checkpoint via save/load_checkpoint.
    if not HAS_FSDP2:
        return  # FSDP2 is public from torch 2.6
    assert all(r["fsdp_changed"] and r["fsdp_restored"] and r["fsdp_extra"] == {"step": 1} for r in results)
    assert all(r["fsdp_values"] == {"step": 1} for r in results)  # checkpoint_values reads a directory too
    assert (tmp_path / "fsdp_ckpt" / ".metadata").exists()
    # each rank's own tracker came back to it; the directory was written aside and renamed into place
    assert [r["fsdp_own_tracker"] for r in results] == [10.0, 11.0]
    assert all(r["fsdp_leftovers"] == [] for r in results)


def test_two_nodes_on_localhost_match_one_process(tmp_path: Path) -> None:
    runs = run_two_nodes(WORKERS / "ddp_train.py", [str(tmp_path)], timeout=240)
    assert [r.returncode for r in runs] == [0, 0], [r.stderr[-2000:] for r in runs]
    _assert_matches_reference(_results(tmp_path))


def test_crashed_worker_resumes_from_the_last_checkpoint_with_the_same_weights(tmp_path: Path) -> None:
    out = run_torchrun(
        WORKERS / "ddp_train.py", [str(tmp_path), "--ckpt-every", "4", "--kill-at", "6"],
        extra_launcher_args=["--max-restarts", "1"], timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exitcode: 3" in out.stderr  # the first attempt really crashed
    assert "resumed at step 4, loader {'epoch': 0, 'batches': 4" in out.stdout  # mid-epoch
    _assert_matches_reference(_results(tmp_path))
    assert not list(tmp_path.glob(".ckpt.pt.*.tmp"))  # no temporary file left behind


def test_train_ddp_example_two_processes_and_one(tmp_path: Path) -> None:
    out = run_torchrun(ROOT / "examples" / "train_ddp.py", ["--epochs", "2"], timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(re.findall(r"^epoch 2: ", out.stdout, flags=re.M)) == 1  # printed by rank 0 only
    last = out.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"test_accuracy=(\d\.\d{4})", last)
    assert match and float(match.group(1)) > 0.8, out.stdout
    single = subprocess.run([sys.executable, "examples/train_ddp.py", "--epochs", "1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=240)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    assert re.fullmatch(r"test_accuracy=\d\.\d{4}", single.stdout.strip().splitlines()[-1])


def test_benchmark_quick_mode_prints_its_table() -> None:
    stdout = run_quick("ddp", timeout=240)
    assert "ratio to 1 process" in stdout and "2 processes (DDP)" in stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_train_ddp_example_with_launch_two() -> None:
    cmd = [sys.executable, "examples/train_ddp.py", "--launch", "2", "--epochs", "1"]
    out = subprocess.run(cmd, cwd=ROOT,
                         env=_env(None), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(re.findall(r"^epoch 1: ", out.stdout, flags=re.M)) == 1  # rank 0 of the 2 launched prints
    match = re.search(r"^test_accuracy=(\d\.\d{4})$", out.stdout, flags=re.M)
    assert match and float(match.group(1)) > 0.5, out.stdout

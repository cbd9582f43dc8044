"""Per-rank state in checkpoints: every rank's pending gradients, RNG states and tracker are saved and each
rank gets its own back, so a DDP run stopped after any micro-step of a window resumes bit for bit.

The 2-process runs are tests/workers/ddp_resume_window.py; the negative controls give rank 1 what rank 0
saved (its pending window, or its RNG states) and must end elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from speedups import LossTracker, accumulate, load_checkpoint, save_checkpoint
from tests._dist import WORKERS, run_torchrun

SCRIPT = WORKERS / "ddp_resume_window.py"
POINTS = ["1", "2", "3", "4", "5", "6"]  # after every micro-step of epoch 0: two windows of 3


def _distance(got: dict, ref: dict) -> float:
    return max((a - b).abs().max().item() for a, b in zip(got["weights"], ref["weights"], strict=True))


def _same(got: dict, ref: dict) -> bool:
    if _distance(got, ref) != 0 or got["updates"] != ref["updates"] or got["tracker"] != ref["tracker"]:
        return False
    return all(
        torch.equal(got["optimizer"][i][key], value) for i, state in ref["optimizer"].items()
        for key, value in state.items()
    )  # fmt: skip


def _give_rank1_what_rank0_saved(src: Path, dst: Path, what: str) -> None:
    raw = torch.load(src, weights_only=True)
    meta = raw["_speedups"]
    if what == "grads":  # rank 1's pending window (gradients, counts) replaced by rank 0's
        assert raw["step"]["pending"] > 0 and meta["per_rank"]["step"][1]["grads"] is not None
        meta["per_rank"]["step"][1] = raw["step"]
    else:
        meta["rng"][1] = meta["rng"][0]
    torch.save(raw, dst)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_ddp_run_resumed_after_every_micro_step_equals_the_uninterrupted_run(
    precision: str, tmp_path: Path
) -> None:
    done = run_torchrun(SCRIPT, [precision, str(tmp_path), "full"], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refs = [torch.load(tmp_path / f"ref-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank, ref in enumerate(refs):
        assert ref["updates"] == (12, 4), ref["updates"]  # every window applied: 4 updates in 12 micro-steps
        assert _same(torch.load(tmp_path / f"saving-rank{rank}.pt", weights_only=True), ref), (
            "saving changed it"
        )
    raw = torch.load(tmp_path / "k1.pt", weights_only=True)
    states = [raw["step"], raw["_speedups"]["per_rank"]["step"][1]]
    assert all(s["pending"] == 1 for s in states)
    assert not torch.equal(states[0]["grads"][0], states[1]["grads"][0])  # the ranks' windows differ
    _give_rank1_what_rank0_saved(tmp_path / "k1.pt", tmp_path / "k1-grads.pt", "grads")
    _give_rank1_what_rank0_saved(tmp_path / "k3.pt", tmp_path / "k3-rng.pt", "rng")
    points = [*POINTS, "1-grads", "3-rng"]
    done = run_torchrun(SCRIPT, [precision, str(tmp_path), "resume", ",".join(points)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for k in POINTS:
        for rank, ref in enumerate(refs):
            got = torch.load(tmp_path / f"resumed-{k}-rank{rank}.pt", weights_only=True)
            assert _same(got, ref), (
                f"{precision}, rank {rank}, resumed after micro-step {k}: {_distance(got, ref)}"
            )
    for k in ("1-grads", "3-rng"):  # negative controls: another rank's state ends elsewhere
        got = [torch.load(tmp_path / f"resumed-{k}-rank{r}.pt", weights_only=True) for r in (0, 1)]
        assert any(_distance(g, ref) > 1e-4 for g, ref in zip(got, refs, strict=True)), k


def test_a_one_process_file_holds_no_per_rank_states_and_a_format_2_file_still_loads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = accumulate(2, opt)(lambda x: model(x).square().mean())
    step(torch.randn(4, 3))
    tracker = LossTracker()
    tracker.update(2.0)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, tracker=tracker)
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert "per_rank" not in raw["_speedups"]
    raw["_speedups"]["format"] = "speedups.checkpoint/2"  # as written before per-rank states existed
    torch.save(raw, tmp_path / "old.pt")
    model2 = nn.Linear(3, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    step2 = accumulate(2, opt2)(lambda x: model2(x).square().mean())
    tracker2 = LossTracker()
    load_checkpoint(tmp_path / "old.pt", model=model2, optimizer=opt2, step=step2, tracker=tracker2)
    assert step2.pending == 1 and tracker2.compute() == 2.0
    assert torch.equal(model2.weight.grad, model.weight.grad)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_ddp_resume_after_any_micro_step_is_exact_when_one_rank_used_a_parameter_the_other_did_not(
    tmp_path: Path,
) -> None:
    """The restored window's gradients were put on the parameters, not made by a backward DDP's reducer saw:
    reduced by DDP at the boundary, the branch one rank had used counted as unused there (0.05 away with
    find_unused_parameters=True). Its boundary is reduced from the gradients themselves."""
    done = run_torchrun(WORKERS / "ddp_one_sided_resume.py", [str(tmp_path)], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"result-rank{rank}.txt").read_text().split()
        results = [lines[i : i + 4] for i in range(0, len(lines), 4)]
        assert len(results) == 8
        wrong = [f"find_unused={u} cut={k}: {e}, {a}" for u, k, e, a in results if e + a != "TrueTrue"]
        assert not wrong, f"rank {rank}: " + "; ".join(wrong)

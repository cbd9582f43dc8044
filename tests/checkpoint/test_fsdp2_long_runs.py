"""FSDP2 long runs at DDP's level: a checkpoint anywhere in a window, background saves, another number of
processes, a stop signal mid-window, each resumed bit for bit (or within the tolerance a changed reduction
order allows) against the uninterrupted run computed in the same test.

The 2-process runs are tests/workers/fsdp2_*.py under torchrun with gloo on 127.0.0.1.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, accumulate, distributed, fast_loader, load_checkpoint
from speedups.checkpoint.layout_change import LayoutError
from tests._dist import FSDP2_REASON, HAS_FSDP2, ROOT, WORKERS, _env, run_torchrun

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


SCRIPT = WORKERS / "fsdp2_resume_window.py"
SEED = int(os.environ.get("SPEEDUPS_CHAOS_SEED", random.randrange(10_000)))
"""Draws the micro-step of the SIGTERM; a failure names it (rerun with ``SPEEDUPS_CHAOS_SEED=<seed>``)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The uninterrupted run on each rank, and the same run saving after each micro-step of epoch 0."""
    out = tmp_path_factory.mktemp("fsdp2")
    done = run_torchrun(SCRIPT, [str(out), "full"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refs = [torch.load(out / f"ref-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert refs[0]["updates"] == (20, 6), refs[0]["updates"]  # 3 windows an epoch, the short one applied
    assert not _equal(refs[0]["tracker"], refs[1]["tracker"])  # each rank its own batches and dropout
    assert not _equal(refs[0]["buffers"], refs[1]["buffers"])  # and its own batch statistics
    return out, refs


def _check_resumed(out: Path, name: str, refs: list[dict], said: str) -> int:
    """Every rank's resumed run ``name`` equals the uninterrupted one; return the micro-step it resumed at."""
    got = [torch.load(out / f"{name}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rank, ref in enumerate(refs):
        ref = {k: v for k, v in ref.items() if k in got[rank]}
        assert _unequal_parts(got[rank], ref) == [], (said, rank, _distance(got[rank], ref))
    assert got[0]["resumed_at"] == got[1]["resumed_at"], said
    return int(got[0]["resumed_at"])


def test_an_fsdp2_run_resumed_after_every_micro_step_equals_the_uninterrupted_run(
    runs: tuple[Path, list[dict]],
) -> None:
    """Checkpoints after each of the 10 micro-steps of epoch 0 (@accumulate(4): windows of 4, 4 and a
    flushed 2), mid-window ones included, each resumed in new processes: weights, batch statistics, optimizer
    state, counters and trackers torch.equal to the uninterrupted run's on every rank."""
    out, refs = runs
    for rank, ref in enumerate(refs):
        saving = torch.load(out / f"saving-rank{rank}.pt", weights_only=True)
        assert _unequal_parts(saving, ref) == [], "saving changed the run"
    points = [str(k) for k in range(1, 11)]
    done = run_torchrun(SCRIPT, [str(out), "resume", ",".join(points)], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for k in points:
        for rank, ref in enumerate(refs):
            got = torch.load(out / f"resumed-{k}-rank{rank}.pt", weights_only=True)
            assert _unequal_parts(got, ref) == [], (rank, k, _distance(got, ref))


def test_background_saves_of_processes_that_end_without_close_resume_equal(
    runs: tuple[Path, list[dict]],
) -> None:
    """RunDirectory(every_updates=1, background=True): DCP's async_save after each update; the processes
    end right after the save at micro-step 14 is handed to DCP (no close(), no destroy_distributed()). The
    interpreter's exit waits for it: the resumed run starts at micro-step 14 and ends torch.equal. The same
    when the processes end by destroy_distributed() and os._exit."""
    out, refs = runs
    done = run_torchrun(SCRIPT, [str(out), "rundir", "bg", "14"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = run_torchrun(SCRIPT, [str(out), "rundir-resume", "bg"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _check_resumed(out, "bg", refs, "background") == 14
    # Ended by destroy_distributed() and os._exit (which waits for nothing): destroy_distributed() waits for
    # the save in flight before the group (DCP's thread uses it) goes.
    done = run_torchrun(SCRIPT, [str(out), "rundir", "destroyed", "14", "destroy"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = run_torchrun(SCRIPT, [str(out), "rundir-resume", "destroyed"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _check_resumed(out, "destroyed", refs, "destroy_distributed") == 14


def test_a_sigterm_at_a_random_micro_step_exits_75_and_the_resumed_run_is_bit_for_bit(
    runs: tuple[Path, list[dict]],
) -> None:
    """One rank gets a real SIGTERM after a random micro-step; the ranks agree on a later one (mid-window
    or not), save there in the background, wait for it and exit 75; the resumed run ends torch.equal."""
    out, refs = runs
    at = random.Random(SEED).randint(1, 12)
    said = f"SPEEDUPS_CHAOS_SEED={SEED}: SIGTERM after micro-step {at}"
    done = run_torchrun(SCRIPT, [str(out), "signal", "sig", str(at)], timeout=300)
    stops = [(out / "sig" / f"stop-rank{r}.txt").read_text().split() for r in (0, 1)]
    assert stops[0] == stops[1] and stops[0][1] == "75", (said, stops, done.stderr[-3000:])
    stopped = int(stops[0][0])
    assert at <= stopped < 20, (said, stopped)
    done = run_torchrun(SCRIPT, [str(out), "rundir-resume", "sig"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _check_resumed(out, "sig", refs, said) == stopped, said


def test_two_ranks_checkpoint_continues_in_one_plain_process_with_the_same_global_batch(
    tmp_path: Path,
) -> None:
    """Saved by 2 FSDP2 ranks after micro-step 4 (@accumulate(4), micro-batches of 2: 16 samples an update),
    loaded by one plain process with no process group into an unwrapped model with @accumulate(8): DCP reads
    the shards whole, the loader deals the micro-batches the 2 ranks would have, the step counts in its own
    micro-steps. Within 1e-5 of the 2-rank run that never stopped (the gradients are summed in another
    order). No dropout or batch norm here: another layout draws other masks, and the gradient of a bias just
    before batch norm is rounding noise that AdamW scales up to whole steps."""
    done = run_torchrun(SCRIPT, [str(tmp_path), "elastic"], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "one"], cwd=ROOT, env=_env(None), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "saved with 2 processes, resumed on 1" in done.stderr  # the RNG states stay as they are: said
    ref = torch.load(tmp_path / "elastic-ref-rank0.pt", weights_only=True)
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert ref["updates"] == (20, 6) and one["updates"] == (40, 6)
    assert _distance(one, ref) < 1e-5, _distance(one, ref)
    # Here too (no process group): the weights alone, for evaluation or export, as DCP saved them whole;
    # a model of other shapes is refused with DCP's reason, naming the directory.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "elastic4", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    net = nn.Sequential(nn.Linear(6, 16), nn.Identity(), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 1))
    assert load_checkpoint(tmp_path / "elastic4", model=net) == {"epoch": 0}  # no word on RNG: not training
    assert all(torch.equal(value, whole[key]) for key, value in net.state_dict().items())
    wrong = nn.Sequential(nn.Linear(6, 8), nn.Identity(), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 1))
    wrong_opt = torch.optim.AdamW(wrong.parameters(), lr=0.02)
    with pytest.raises(SpeedupsError, match=r"elastic4'\): torch.distributed.checkpoint .*Size mismatch"):
        load_checkpoint(tmp_path / "elastic4", model=wrong, optimizer=wrong_opt)
    assert not wrong_opt.state  # the state torch's get_optimizer_state_dict made to read into: gone again
    # Refused before anything changes: another global batch (the layout), another optimizer class.
    fresh = nn.Sequential(nn.Linear(6, 16), nn.Identity(), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 1))
    before = {key: value.clone() for key, value in fresh.state_dict().items()}
    opt = torch.optim.AdamW(fresh.parameters(), lr=0.02)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    loader = distributed(fast_loader(data, 2, shuffle=True, num_workers=0))
    step = accumulate(4, opt, model=fresh)(lambda x, y: torch.nn.functional.mse_loss(fresh(x), y))
    with pytest.raises(LayoutError, match=r"16 samples per optimizer step; this run has .* 8 samples"):
        load_checkpoint(tmp_path / "elastic4", model=fresh, optimizer=opt, loader=loader, step=step)
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with pytest.raises(SpeedupsError, match=r"saved from optimizer class AdamW, and this one is a SGD"):
        load_checkpoint(tmp_path / "elastic4", model=fresh, optimizer=sgd)
    assert all(torch.equal(value, before[key]) for key, value in fresh.state_dict().items())
    assert not opt.state and not sgd.state and step.step == 0 and loader.state_dict()["batches"] == 0

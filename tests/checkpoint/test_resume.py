"""The resume contract: a run stopped after any micro-step, saved with save_checkpoint and resumed in a fresh
process equals the uninterrupted run bit for bit (weights, optimizer state, loss scale, tracker, LR, and
the batches that follow). The fresh-process runs are tests/workers/resume_run.py (slow); the pieces of the
contract (no global RNG draw after a restore, lazily built scalers, epoch()) are tested in-process below."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedups import (
    SpeedupsError,
    accumulate,
    distributed,
    fast_loader,
    load_checkpoint,
    mixed_precision,
    save_checkpoint,
)
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
    tail = [seen for seen in ref["seen"] if seen[0] > from_step]
    assert [seen[0] for seen in got["seen"]] == [seen[0] for seen in tail], what
    for (_, idx, x), (_, ref_idx, ref_x) in zip(got["seen"], tail, strict=True):  # the same batches
        assert torch.equal(idx, ref_idx) and torch.equal(x, ref_x), what


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "augment"])
def test_resume_after_every_micro_step_equals_the_uninterrupted_run(precision: str, tmp_path: Path) -> None:
    _run(precision, str(tmp_path), "full")
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    # Saving itself changes nothing: the run that saved after every micro-step is the reference run.
    _assert_same(torch.load(tmp_path / "saving.pt", weights_only=True), ref, 0, "the saving run")
    assert ref["updates"] == (10, 4 if precision != "fp16" else 2)  # fp16: the first 2 windows overflow
    assert ref["scale"] == (2.0**15 if precision == "fp16" else None)
    _run(precision, str(tmp_path), "resume", ",".join(POINTS))  # one fresh (forked) process per point
    for k in POINTS:
        got = torch.load(tmp_path / f"resumed-{k}.pt", weights_only=True)
        _assert_same(got, ref, 5 if k == "end" else int(k), f"{precision}, resumed after micro-step {k}")


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_under_torchrun_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    done = run_torchrun(SCRIPT, ["fp16", str(tmp_path), "full"], timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for k in ("2", "3", "end"):  # 10 samples per rank: 3 micro-steps per epoch (windows of 3)
        done = run_torchrun(SCRIPT, ["fp16", str(tmp_path), "resume", k], timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        ref = torch.load(tmp_path / f"ref-rank{rank}.pt", weights_only=True)
        _assert_same(torch.load(tmp_path / f"saving-rank{rank}.pt", weights_only=True), ref, 0, "saving")
        for k in ("2", "3", "end"):
            got = torch.load(tmp_path / f"resumed-{k}-rank{rank}.pt", weights_only=True)
            _assert_same(got, ref, 3 if k == "end" else int(k), f"rank {rank}, resumed after {k}")


# ------------------------------------------------------------------------------------- in-process pieces
def _dropout_run(path: Path, stop_after: int | None, resume: bool = False) -> list[torch.Tensor]:
    """A plain loop over a shuffled distributed(loader) with dropout; saves after `stop_after` batches."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g))
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = distributed(DataLoader(data, batch_size=4, shuffle=True))
    if resume:
        load_checkpoint(path, model=model, optimizer=opt, loader=loader)
    for _epoch in range(loader.state_dict()["epoch"], 2):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if stop_after is not None and i + 1 == stop_after:
                save_checkpoint(path, model=model, optimizer=opt, loader=loader)
                return []
    return [p.detach().clone() for p in model.parameters()]


def test_a_restored_loader_draws_nothing_the_uninterrupted_run_does_not(tmp_path: Path) -> None:
    full = _dropout_run(tmp_path / "c.pt", None)
    _dropout_run(tmp_path / "c.pt", stop_after=3)
    resumed = _dropout_run(tmp_path / "c.pt", None, resume=True)
    for a, b in zip(resumed, full, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    # Directly: iterating the restored loader leaves the (restored) global RNG where it was.
    loader = distributed(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    fresh = distributed(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    fresh.load_state_dict(state)
    before = torch.get_rng_state()
    next(iter(fresh))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_loaders_own_generator_is_saved_and_its_draw_replayed() -> None:
    def build():
        return distributed(fast_loader(list(range(12)), 2, shuffle=True, num_workers=0, seed=5))

    ref = build()
    it = iter(ref)
    next(it)
    state = ref.state_dict()
    rest = [b.tolist() for b in it]
    after_epoch0 = ref.generator.get_state()
    next_epoch = [b.tolist() for b in ref]
    resumed = build()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.generator.get_state(), state["generator"])
    assert [b.tolist() for b in resumed] == rest
    assert torch.equal(resumed.generator.get_state(), after_epoch0)  # the replayed draw took nothing
    assert [b.tolist() for b in resumed] == next_epoch


def test_loading_into_a_loader_whose_iterator_runs_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    loader = distributed(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1), loader=loader)
    it = iter(loader)
    next(it)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SpeedupsError, match=r"still running \(epoch 0, 1 batches.*before the loop starts"):
        load_checkpoint(tmp_path / "c.pt", model=model, loader=loader)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    assert loader.state_dict()["batches"] == 1
    list(it)  # once that pass is over, loading is fine
    load_checkpoint(tmp_path / "c.pt", model=model, loader=loader)


def _fp16(init_scale: float = 2.0**17):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp = mixed_precision("fp16", device_type="cpu", init_scale=init_scale)
    step = accumulate(2, opt)(amp(lambda x, y: F.mse_loss(model(x), y)))
    return model, opt, amp, step


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 4, generator=g), 10 * torch.randn(4, 1, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("save_amp", [False, True])
@pytest.mark.parametrize("stop", [1, 2, 3])
def test_the_step_alone_resumes_fp16_exactly(tmp_path: Path, save_amp: bool, stop: int) -> None:
    data = _batches(6)
    model, opt, amp, step = _fp16()
    for x, y in data:
        step(x, y)
    ref_scale, ref = amp.scaler.get_scale(), [p.detach().clone() for p in model.parameters()]
    assert ref_scale < 2.0**17  # windows overflowed and the scale dropped: the scale matters here
    model, opt, amp, step = _fp16()
    for x, y in data[:stop]:
        step(x, y)
    extra = {"amp": amp} if save_amp else {}
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, **extra)
    model, opt, amp, step = _fp16()
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, **extra)
    assert step.scaler is None  # the scaler comes with the first call; the saved scale waits for it
    for x, y in data[stop:]:
        step(x, y)
    assert step.scaler is amp.scaler and amp.scaler.get_scale() == ref_scale
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters(), strict=True))


def test_a_restored_fp16_window_flushed_before_any_call_is_unscaled(tmp_path: Path) -> None:
    data = _batches(3)
    model, opt, amp, step = _fp16(init_scale=256.0)
    for x, y in data:
        step(x, y)
    step.flush()
    ref_scale, ref = amp.scaler.get_scale(), [p.detach().clone() for p in model.parameters()]
    model, opt, amp, step = _fp16(init_scale=256.0)
    for x, y in data:
        step(x, y)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step)
    model, opt, amp, step = _fp16(init_scale=256.0)
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step)
    step.flush()  # no fp16 call yet: a GradScaler from the saved state unscales the window
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters(), strict=True))
    assert step.scaler.get_scale() == ref_scale
    step(*data[0])  # then mixed_precision's own scaler takes over, continuing that state
    assert step.scaler is amp.scaler and amp.scaler.get_scale() >= ref_scale


def _epoch_setup():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g))
    loader = distributed(DataLoader(data, batch_size=4, shuffle=True))
    step = accumulate(3, opt)(lambda x, y: F.mse_loss(model(x), y))
    return model, opt, loader, step


def _save_in_epoch_after_four_calls(path: Path):  # -> what _epoch_setup returns
    """Save mid-epoch, mid-window (4 calls of a 3-call window), then break out of epoch() without flush().

    Returns what ``_epoch_setup`` made, the step's window still open."""
    model, opt, loader, step = _epoch_setup()
    for i, (x, y) in enumerate(step.epoch(loader)):
        step(x, y)
        if i == 3:
            save_checkpoint(path, model=model, optimizer=opt, loader=loader, step=step)
            break
    return model, opt, loader, step


def test_epoch_continues_a_window_restored_from_the_same_epoch(tmp_path: Path) -> None:
    model, opt, loader, step = _epoch_setup()
    for _ in range(2):
        for x, y in step.epoch(loader):
            step(x, y)
    ref = [p.detach().clone() for p in model.parameters()]
    _save_in_epoch_after_four_calls(tmp_path / "c.pt")
    model, opt, loader, step = _epoch_setup()
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, loader=loader, step=step)
    assert step.pending == 1
    for _ in range(2):
        for x, y in step.epoch(loader):
            step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(ref, model.parameters(), strict=True))


def test_epoch_still_refuses_a_window_left_over_from_an_earlier_epoch(tmp_path: Path) -> None:
    model, opt, loader, step = _save_in_epoch_after_four_calls(tmp_path / "c.pt")
    # The loop broke out without flush(): the next epoch must not silently absorb that window.
    with pytest.raises(SpeedupsError, match="1 micro-steps of an earlier epoch are still pending"):
        next(iter(step.epoch(loader)))
    # Restored with a loader that starts a new epoch (not loaded with the checkpoint): refused too.
    model, opt, loader, step = _epoch_setup()
    load_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step)
    with pytest.raises(SpeedupsError, match="starts epoch 0 at batch 0: load it with the checkpoint"):
        next(iter(step.epoch(loader)))
    # A window saved outside epoch() (a plain loop) is not epoch()'s to continue.
    model, opt, loader, step = _epoch_setup()
    for x, y in list(loader)[:2]:
        step(x, y)
    save_checkpoint(tmp_path / "d.pt", optimizer=opt, step=step)
    model, opt, loader, step = _epoch_setup()
    load_checkpoint(tmp_path / "d.pt", optimizer=opt, step=step)
    with pytest.raises(SpeedupsError, match="2 micro-steps of an earlier epoch"):
        next(iter(step.epoch(loader)))

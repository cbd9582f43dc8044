"""save_checkpoint / load_checkpoint in one process (the multi-process and crash runs are in
tests/test_distributed_jobs.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from speedups import LossTracker, SpeedupsError, distributed, load_checkpoint, save_checkpoint


def _setup(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = distributed(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    return model, opt, sched, loader, LossTracker()


def _train(model, opt, sched, loader, tracker, batches: int) -> None:
    it = iter(loader)
    for _ in range(batches):
        batch = next(it).float().unsqueeze(1).expand(-1, 3)
        loss = model(batch).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker.update(loss, n=len(batch))
    sched.step()


def test_round_trip_resumes_exactly(tmp_path: Path) -> None:
    a = _setup(0)
    _train(*a, batches=3)
    path = save_checkpoint(tmp_path / "sub" / "ckpt.pt", model=a[0], optimizer=a[1], scheduler=a[2],
                           loader=a[3], tracker=a[4], step=3)  # fmt: skip
    rng_after_save = (torch.rand(2), random.random())
    b = _setup(1)
    assert load_checkpoint(path, model=b[0], optimizer=b[1], scheduler=b[2], loader=b[3], tracker=b[4]) == {
        "step": 3
    }
    assert (torch.rand(2).tolist(), random.random()) == (rng_after_save[0].tolist(), rng_after_save[1])
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    assert b[2].get_last_lr() == a[2].get_last_lr() and b[4].compute() == a[4].compute()
    # The resumed loader yields the rest of epoch 0 (neither replayed nor skipped), then epoch 1 as usual.
    reference = distributed(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    epoch0, epoch1 = [[x.tolist() for x in reference] for _ in range(2)]
    assert [x.tolist() for x in b[3]] == epoch0[3:] and [x.tolist() for x in b[3]] == epoch1
    # The optimizer state came back too: the same next step from the same weights gives the same weights.
    for model, opt in ((a[0], a[1]), (b[0], b[1])):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    assert not list(path.parent.glob(".*tmp"))


def test_load_validates_before_changing_anything(tmp_path: Path) -> None:
    model, opt, *_ = _setup(0)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt)
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    other_opt = torch.optim.Adam(other.parameters())
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(SpeedupsError, match=r"model.2.weight has shape \(2, 4\) here and \(1, 4\)"):
        load_checkpoint(tmp_path / "c.pt", optimizer=other_opt, model=other)
    assert all(torch.equal(p, q) for p, q in zip(before, other.parameters(), strict=True))
    assert other_opt.state_dict()["state"] == {}
    with pytest.raises(SpeedupsError, match=r"\['tracker'\] were not saved"):
        load_checkpoint(tmp_path / "c.pt", model=model, tracker=LossTracker())
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "missing.pt", model=model)
    torch.save({"x": 1}, tmp_path / "foreign.pt")
    with pytest.raises(SpeedupsError, match="not a checkpoint written by speedups"):
        load_checkpoint(tmp_path / "foreign.pt", model=model)


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="A plain DataLoader has no state"):
        save_checkpoint(tmp_path / "c.pt", loader=DataLoader([1, 2]))
    with pytest.raises(ValueError, match="nothing to save"):
        save_checkpoint(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "c.pt", _x=1)
    with pytest.raises(TypeError, match="plain values cannot be loaded into"):
        load_checkpoint(tmp_path / "c.pt", step=3)


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model = nn.Linear(2, 1)
    path = save_checkpoint(tmp_path / "c.pt", model=model, step=1)

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(SpeedupsError, match=r"could not write the checkpoint.*disk full"):
        save_checkpoint(path, model=model, step=2)
    monkeypatch.undo()
    assert load_checkpoint(path, model=nn.Linear(2, 1)) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_ddp_state_is_saved_with_the_plain_modules_keys(tmp_path: Path) -> None:
    # No process group here: the keys of an unwrapped model; the DDP case runs in the torchrun tests.
    model = nn.Linear(2, 1)
    save_checkpoint(tmp_path / "c.pt", model=model)
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert set(raw["model"]) == {"weight", "bias"}


def test_tracker_all_ranks_without_a_process_group_reads_local_values() -> None:
    tracker = LossTracker(all_ranks=True)
    tracker.update(torch.tensor(1.0), n=3)
    tracker.update(2.0)
    assert tracker.compute() == pytest.approx(1.25) and tracker.state_dict()["all_ranks"] is True
    with pytest.raises(TypeError, match="all_ranks=1"):
        LossTracker(all_ranks=1)  # type: ignore[arg-type]


def test_a_failing_load_puts_back_what_it_had_loaded(tmp_path: Path) -> None:
    from speedups import accumulate

    torch.manual_seed(0)
    model, tracker = nn.Linear(3, 1), LossTracker()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step2 = accumulate(2, opt)(lambda: model(torch.ones(2, 3)).sum())
    step2()
    tracker.update(1.0)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, opt=opt, step=step2, tracker=tracker)

    fresh = nn.Linear(3, 1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh_tracker = LossTracker()
    fresh_tracker.update(5.0)
    step4 = accumulate(4, fresh_opt)(lambda: fresh(torch.ones(2, 3)).sum())  # another window size: refused
    weights = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(ValueError, match="accumulated over 2 micro-steps"):
        load_checkpoint(path, model=fresh, opt=fresh_opt, tracker=fresh_tracker, step=step4)
    torch.testing.assert_close([p.detach() for p in fresh.parameters()], weights, atol=0, rtol=0)
    assert not fresh_opt.state and fresh_tracker.compute() == 5.0 and len(fresh_tracker) == 1


def test_optimizer_state_of_other_shapes_is_refused(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c.pt", opt=opt)
    other = nn.Linear(5, 2)  # same number of parameters, other shapes
    other_opt = torch.optim.Adam(other.parameters())
    with pytest.raises(SpeedupsError, match=r"state 'exp_avg' of parameter 0 has shape \(1, 3\)"):
        load_checkpoint(tmp_path / "c.pt", opt=other_opt)
    assert not other_opt.state


def test_a_checkpoint_of_plain_values_reads_back(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "p.pt", epoch=3, note="x")
    assert load_checkpoint(tmp_path / "p.pt") == {"epoch": 3, "note": "x"}


def test_a_file_that_is_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(SpeedupsError, match=r"not a checkpoint written by speedups\.save_checkpoint"):
        load_checkpoint(junk, model=nn.Linear(2, 1))
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(2)}, other)  # a torch file, but not ours
    with pytest.raises(SpeedupsError, match=r"not a checkpoint written by speedups\.save_checkpoint"):
        load_checkpoint(other, model=nn.Linear(2, 1))

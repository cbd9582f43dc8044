"""save_checkpoint / load_checkpoint in one process (the multi-process and crash runs are in
tests/test_distributed_jobs.py)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from speedups import (
    LossTracker,
    SpeedupsError,
    SpeedupsWarning,
    distributed,
    load_checkpoint,
    save_checkpoint,
)


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
    with pytest.raises(TypeError, match="A plain DataLoader has no state") as err:
        save_checkpoint(tmp_path / "c.pt", loader=DataLoader([1, 2]))
    assert "loader = distributed(loader, seed=0) (it works in one process too" in str(err.value)
    with pytest.raises(TypeError, match=r"save_checkpoint\(gen=Generator\).*gen=gen\.get_state\(\)") as err:
        save_checkpoint(tmp_path / "c.pt", gen=torch.Generator())  # not a DataLoader: no DataLoader advice
    assert "DataLoader has no state" not in str(err.value)
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
    with pytest.raises(
        SpeedupsError,
        match=r"1 process x accumulate\(2\) = 2 micro-batches per optimizer step; "
        r"this run has 1 process x accumulate\(4\).*decorate the step with accumulate\(2, ...\)",
    ):
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


# ------------------------------------------------------------------------------ checked before any change
def _snapshot(*objects) -> list:
    import copy

    return [copy.deepcopy(o.state_dict()) for o in objects]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _trained(seed: int = 0, opt_class=torch.optim.SGD, **opt_kwargs):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = opt_class(model.parameters(), lr=0.1, **opt_kwargs)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return model, opt


def test_an_optimizer_of_another_class_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model, sgd = _trained(0, momentum=0.9)
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=sgd)
    torch.save({"model": model.state_dict(), "optimizer": sgd.state_dict()}, tmp_path / "foreign.pt")
    fresh, adam = _trained(1, torch.optim.Adam)
    before = _snapshot(fresh, adam)
    with pytest.raises(SpeedupsError, match="saved from optimizer class SGD, and this one is a Adam"):
        load_checkpoint(tmp_path / "c.pt", model=fresh, optimizer=adam)
    # A foreign file records no class: the parameter groups' hyperparameter keys tell.
    with pytest.raises(SpeedupsError, match=r"hyperparameters \['dampening', 'momentum', 'nesterov'\]"):
        load_checkpoint(tmp_path / "foreign.pt", model=fresh, optimizer=adam)
    assert _same(_snapshot(fresh, adam), before)
    adam.step()  # still a working Adam


def test_bad_entries_are_refused_before_any_object_changes(tmp_path: Path) -> None:
    from speedups import accumulate, mixed_precision

    model, opt = _trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    tracker = LossTracker()
    tracker.update(2.0)
    loader = distributed(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, tracker=tracker,
                    loader=loader, amp=mixed_precision("bf16", device_type="cpu"))  # fmt: skip
    fresh, fresh_opt = _trained(1)
    objects = {
        "model": fresh,
        "optimizer": fresh_opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1),
        "tracker": LossTracker(),
        "loader": distributed(DataLoader(list(range(8)), batch_size=2, shuffle=True)),
    }
    objects["tracker"].update(5.0)
    cases = [
        ({"scheduler": torch.optim.lr_scheduler.ExponentialLR(fresh_opt, 0.9)}, SpeedupsError,
         "saved from scheduler class StepLR"),
        ({"model": nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))}, SpeedupsError,
         r"model.2.weight has shape \(2, 4\) here and \(1, 4\)"),
        ({"model": nn.Linear(3, 1)}, SpeedupsError, r"missing \['bias', 'weight'\].*another model"),
        ({"missing": LossTracker()}, SpeedupsError, r"\['missing'\] were not saved"),
        ({"amp": mixed_precision("fp16", device_type="cpu")}, ValueError,
         "amp: .*saved with dtype torch.bfloat16"),
        ({"step": accumulate(2, fresh_opt)(lambda: fresh(torch.ones(1, 3)).sum())}, SpeedupsError,
         r"\['step'\] were not saved"),
    ]  # fmt: skip
    for change, error, match in cases:
        state = {**objects, **change}
        before = _snapshot(*state.values())
        with pytest.raises(error, match=match):
            load_checkpoint(tmp_path / "c.pt", **state)
        assert _same(_snapshot(*state.values()), before), match
    with pytest.raises(SpeedupsError, match=r"no entry \['weights'\]|\['weights'\] were not saved"):
        load_checkpoint(tmp_path / "c.pt", model=fresh, keys={"model": "weights"})
    with pytest.raises(ValueError, match=r"\['modle'\] name no object passed"):
        load_checkpoint(tmp_path / "c.pt", model=fresh, keys={"modle": "model"})
    with pytest.raises(TypeError, match="expected a dict of argument name -> entry name"):
        load_checkpoint(tmp_path / "c.pt", model=fresh, keys=["model"])  # type: ignore[arg-type]
    load_checkpoint(tmp_path / "c.pt", **objects)  # the unchanged objects do load
    assert objects["tracker"].compute() == 2.0


def test_damaged_files_and_directories_are_named(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "c.pt", model=nn.Linear(3, 1), epoch=1)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        SpeedupsError, match=rf"{cut}.*torch.save archive of {len(data) // 2} bytes.*truncated"
    ):
        load_checkpoint(cut, model=nn.Linear(3, 1))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(SpeedupsError, match=rf"{empty}.*empty \(0 bytes\)"):
        load_checkpoint(empty, model=nn.Linear(3, 1))
    with pytest.raises(SpeedupsError, match=r"is a directory, but not an FSDP2 checkpoint \(no .metadata"):
        load_checkpoint(tmp_path, model=nn.Linear(3, 1))
    with pytest.raises(SpeedupsError, match=r"could not write.*is a directory"):
        save_checkpoint(tmp_path, model=nn.Linear(3, 1))
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(SpeedupsError, match="holds a list, not a dict of entries"):
        load_checkpoint(tmp_path / "list.pt")
    torch.save({"model": _Opaque()}, tmp_path / "objects.pt")
    with pytest.raises(
        SpeedupsError, match=r"pickled Python objects that torch.load\(weights_only=True\) refuses"
    ):
        load_checkpoint(tmp_path / "objects.pt")


class _Opaque:
    pass


def _damage(path: Path, out: Path, change) -> Path:
    payload = torch.load(path, weights_only=True)
    change(payload["_speedups"])
    torch.save(payload, out)
    return out


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda meta: meta["rng"][0].pop("random"), r"saved RNG states are damaged \(KeyError: 'random'\)"),
        (
            lambda meta: meta["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
            "RNG states are damaged",
        ),
        (lambda meta: meta.update(objects=["model"]), r"'_speedups' entry is damaged.*got list"),
        (lambda meta: meta.pop("objects"), r"'_speedups' entry is damaged.*got NoneType"),
        (lambda meta: meta.update(rng="x"), r"'_speedups' entry is damaged.*and str"),
    ],
)
def test_damaged_metadata_is_refused_before_any_object_or_rng_changes(tmp_path: Path, change, match) -> None:
    torch.manual_seed(0)
    path = save_checkpoint(tmp_path / "c.pt", model=nn.Linear(3, 1), epoch=1)
    bad = _damage(path, tmp_path / "bad.pt", change)
    model = nn.Linear(3, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(SpeedupsError, match=match):
        load_checkpoint(bad, model=model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize(("saved", "visible"), [(2, 1), (1, 2), (2, 2)])
def test_cuda_rng_states_of_another_gpu_count_are_skipped_with_a_warning(
    tmp_path, monkeypatch, saved, visible
):
    """A resume that sees another number of GPUs (CUDA_VISIBLE_DEVICES changed) restores everything but the
    CUDA RNG states, and says so, where torch's set_rng_state_all would raise after the model was loaded.
    CUDA stood in: device counts monkeypatched, the states recorded."""
    path = save_checkpoint(tmp_path / "c.pt", model=nn.Linear(3, 1), epoch=1)
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(saved)]
    gpu = _damage(path, tmp_path / "gpu.pt", lambda meta: meta["rng"][0].update(cuda=states))
    restored: list[list[torch.Tensor]] = []

    def set_rng_state_all(new: list[torch.Tensor]) -> None:  # torch's: one state per visible device
        if len(new) > visible:
            raise IndexError("invalid device index")
        restored.append(list(new))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)
    model = nn.Linear(3, 1)
    if saved == visible:
        assert load_checkpoint(gpu, model=model)["epoch"] == 1
        assert [[int(t[0]) for t in r] for r in restored] == [list(range(saved))]
        return
    with pytest.warns(
        SpeedupsWarning, match=rf"CUDA RNG states of {saved} GPUs and this process sees {visible}"
    ):
        assert load_checkpoint(gpu, model=model)["epoch"] == 1
    assert restored == []  # nothing half-restored
    saved_weights = torch.load(path, weights_only=True)["model"]
    assert all(torch.equal(saved_weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("path", "error"), [(3, TypeError), (None, TypeError), ("", ValueError)])
def test_a_path_that_is_no_file_name_is_refused_naming_path(tmp_path: Path, path, error) -> None:
    with pytest.raises(error, match=r"save_checkpoint\(path=.*expected the checkpoint's file name"):
        save_checkpoint(path, model=nn.Linear(3, 1))
    with pytest.raises(error, match=r"load_checkpoint\(path=.*expected the checkpoint's file name"):
        load_checkpoint(path, model=nn.Linear(3, 1))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_file_mode_follows_the_umask_like_torch_save(tmp_path: Path, umask: int) -> None:
    import os

    old = os.umask(umask)
    try:
        save_checkpoint(tmp_path / "ours.pt", x=1)
        torch.save({"x": 1}, tmp_path / "torch.pt")
    finally:
        os.umask(old)
    mode = (tmp_path / "ours.pt").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask == (tmp_path / "torch.pt").stat().st_mode & 0o777


# ----------------------------------------------------------------------------------------------- portable
def _walk_types(value) -> set[str]:
    if isinstance(value, dict):
        return {type(value).__module__} | {t for v in value.values() for t in _walk_types(v)}
    if isinstance(value, (list, tuple)):
        return {type(value).__module__} | {t for v in value for t in _walk_types(v)}
    return {type(value).__module__}


def test_the_file_is_a_plain_dict_with_the_documented_layout(tmp_path: Path) -> None:
    from speedups import accumulate

    model, opt = _trained(0)
    opt.zero_grad()  # the hand-written training's last gradients: not the step's window
    step = accumulate(2, opt)(lambda: model(torch.ones(1, 3)).sum())
    step()
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, tracker=LossTracker(),
                    loader=distributed(DataLoader(list(range(4)))), epoch=2)  # fmt: skip
    raw = torch.load(tmp_path / "c.pt", weights_only=True)  # plain types only, or weights_only refuses
    assert not any(t.startswith("speedups") for t in _walk_types(raw))
    assert set(raw) == {"model", "optimizer", "step", "tracker", "loader", "epoch", "_speedups"}
    meta = raw["_speedups"]
    assert (
        meta["format"] == "speedups.checkpoint/3"
        and "per_rank" not in meta
        and meta["world_size"] == 1
        and len(meta["rng"]) == 1
    )
    assert meta["objects"] == {"model": "Sequential", "optimizer": "SGD", "step": "Step",
                               "tracker": "LossTracker", "loader": "DistributedLoader"}  # fmt: skip
    assert _same(raw["model"], model.state_dict()) and raw["epoch"] == 2


def test_wrapped_models_save_plain_keys_and_load_into_any_wrapper(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    compiled = torch.compile(plain, backend="eager")
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    save_checkpoint(tmp_path / "c.pt", model=compiled)
    assert set(torch.load(tmp_path / "c.pt", weights_only=True)["model"]) == set(plain.state_dict())
    for target in (
        nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)),
        torch.compile(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), backend="eager"),
        nn.DataParallel(torch.compile(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), backend="eager")),
    ):
        load_checkpoint(tmp_path / "c.pt", model=target)
        assert _same(target.state_dict() if isinstance(target, nn.Sequential) else
                     {k.split("_orig_mod.")[-1]: v for k, v in target.state_dict().items()},
                     plain.state_dict())  # fmt: skip
    # Files written by others from wrapped models (DDP's `module.`, compile's `_orig_mod.`, both) load too.
    for prefix in ("module.", "_orig_mod.", "module._orig_mod."):
        torch.save({"model": {prefix + k: v for k, v in plain.state_dict().items()}}, tmp_path / "w.pt")
        target = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        assert load_checkpoint(tmp_path / "w.pt", model=target) == {}
        assert _same(target.state_dict(), plain.state_dict())


def test_foreign_checkpoints_load_through_keys(tmp_path: Path) -> None:
    model, opt = _trained(0, torch.optim.Adam)
    torch.save({"epoch": 3, "state_dict": model.state_dict(), "optimizer": opt.state_dict(), "best_acc": 0.9},
               tmp_path / "theirs.pt")  # fmt: skip
    fresh, fresh_opt = _trained(1, torch.optim.Adam)
    rng = torch.get_rng_state()
    values = load_checkpoint(
        tmp_path / "theirs.pt", model=fresh, optimizer=fresh_opt, keys={"model": "state_dict"}
    )
    assert values == {"epoch": 3, "best_acc": 0.9}
    assert _same(fresh.state_dict(), model.state_dict()) and _same(fresh_opt.state_dict(), opt.state_dict())
    assert torch.equal(torch.get_rng_state(), rng)  # a foreign file has no RNG state to restore
    with pytest.raises(SpeedupsError, match=r"no entry \['model'\]; it holds \['best_acc', 'epoch'.*keys="):
        load_checkpoint(tmp_path / "theirs.pt", model=fresh)
    with pytest.raises(SpeedupsError, match=r"model \(entry 'epoch'\) is a int, not a model's state_dict"):
        load_checkpoint(tmp_path / "theirs.pt", model=fresh, keys={"model": "epoch"})
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    with pytest.raises(SpeedupsError, match="looks like a bare model state_dict"):
        load_checkpoint(tmp_path / "bare.pt", model=fresh)


def test_a_foreign_file_asked_for_a_speedups_objects_state_says_to_leave_it_out(tmp_path: Path) -> None:
    """A plain torch.save file cannot hold a step's window: leaving `step=` out helps, `keys=` would not."""
    from speedups import accumulate

    model, opt = _trained(0, torch.optim.Adam)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "theirs.pt")
    fresh, fresh_opt = _trained(1, torch.optim.Adam)
    fresh_opt.zero_grad()
    train_step = accumulate(2, fresh_opt)(lambda: fresh(torch.ones(1, 3)).sum())
    before = copy.deepcopy(fresh.state_dict())
    told = r"state of \['step', 'tracker'\].*Leave them out.*\(path, model=\.\.\., optimizer=\.\.\.\)"
    with pytest.raises(SpeedupsError, match=told) as err:
        load_checkpoint(tmp_path / "theirs.pt", model=fresh, optimizer=fresh_opt, step=train_step,
                        tracker=LossTracker())  # fmt: skip
    assert "keys=" not in str(err.value) and _same(fresh.state_dict(), before)  # nothing loaded
    load_checkpoint(tmp_path / "theirs.pt", model=fresh, optimizer=fresh_opt)  # the way it says
    assert _same(fresh.state_dict(), model.state_dict())


def test_checkpoints_of_the_first_layout_still_load(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    torch.save({"format": "speedups.checkpoint/1", "world_size": 1, "objects": {"model": model.state_dict()},
                "plain": {"step": 4}, "rng": [{"torch": torch.get_rng_state(), "random": random.getstate()}]},
               tmp_path / "v1.pt")  # fmt: skip
    fresh = nn.Linear(2, 1)
    assert load_checkpoint(tmp_path / "v1.pt", model=fresh) == {"step": 4}
    assert _same(fresh.state_dict(), model.state_dict())


# ----------------------------------------------------------------------- values first, partial loads
def test_a_model_is_built_from_the_checkpoints_values_then_loaded(tmp_path) -> None:
    """nanoGPT keeps model_args in the checkpoint: read them, build the model, load it."""
    from speedups import checkpoint_values

    torch.manual_seed(0)
    args = {"n_in": 5, "hidden": 7}
    model = nn.Sequential(nn.Linear(args["n_in"], args["hidden"]), nn.Tanh(), nn.Linear(args["hidden"], 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, model_args=args, iter_num=7)
    values = checkpoint_values(tmp_path / "ckpt.pt")
    assert values == {"model_args": args, "iter_num": 7}  # no object was loaded or built
    built = nn.Sequential(nn.Linear(values["model_args"]["n_in"], values["model_args"]["hidden"]), nn.Tanh(),
                          nn.Linear(values["model_args"]["hidden"], 1))  # fmt: skip
    load_checkpoint(tmp_path / "ckpt.pt", model=built)
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), model.parameters(), strict=True))
    foreign = tmp_path / "theirs.pt"
    torch.save({"state_dict": model.state_dict(), "epoch": 3, "config": {"lr": 0.1}}, foreign)
    assert checkpoint_values(foreign) == {"epoch": 3, "config": {"lr": 0.1}}  # the state dict is no value
    with pytest.raises(FileNotFoundError):
        checkpoint_values(tmp_path / "missing.pt")


def test_strict_false_loads_a_backbone_into_a_model_with_a_new_head(tmp_path) -> None:
    torch.manual_seed(0)
    pretrained = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))  # a 10-class head
    save_checkpoint(tmp_path / "ckpt.pt", model=pretrained, epoch=5)
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 1)
    )  # new head, extra layer
    head_before = [p.detach().clone() for p in (*model[2].parameters(), *model[3].parameters())]
    with pytest.raises(SpeedupsError, match=r"shape \(3, 8\) here and \(10, 8\)|keys differ"):
        load_checkpoint(tmp_path / "ckpt.pt", model=model)  # strict: refused, nothing changed
    assert torch.equal(model[2].weight, head_before[0])
    with pytest.warns(
        SpeedupsWarning,
        match=r"strict=False: model loaded 2 of 6 entries; these keep their current values: missing from the "
        r"file \['3.bias', '3.weight'\], another shape \['2.bias', '2.weight'\]; unused from the file: \[\]",
    ) as rec:
        values = load_checkpoint(tmp_path / "ckpt.pt", model=model, strict=False)
    assert values == {"epoch": 5} and rec[0].filename == __file__
    assert torch.equal(model[0].weight, pretrained[0].weight) and torch.equal(
        model[0].bias, pretrained[0].bias
    )
    after = [p.detach() for p in (*model[2].parameters(), *model[3].parameters())]
    assert all(
        torch.equal(a, b) for a, b in zip(after, head_before, strict=True)
    )  # the new head kept its init
    with pytest.raises(TypeError, match=r"strict=1: expected True or False"):
        load_checkpoint(tmp_path / "ckpt.pt", model=model, strict=1)


def test_objects_given_by_position_are_refused_with_their_names_as_the_fix(tmp_path) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"save_checkpoint\(path, <Linear, SGD>\): objects go by name.* "
                       r"save_checkpoint\(path, model=model, optimizer=optimizer\)"):  # fmt: skip
        save_checkpoint(tmp_path / "ckpt.pt", model, opt)
    assert not (tmp_path / "ckpt.pt").exists()
    save_checkpoint(tmp_path / "ckpt.pt", model=model)
    with pytest.raises(
        TypeError, match=r"load_checkpoint\(path, <Linear>\).*load_checkpoint\(path, model=model\)"
    ):
        load_checkpoint(tmp_path / "ckpt.pt", model)


def test_checkpoint_values_of_odd_files_and_directories(tmp_path) -> None:
    from speedups import checkpoint_values

    bare = tmp_path / "bare.pt"
    torch.save({"w": torch.zeros(3), "epoch": 2}, bare)  # a bare state_dict-like file: its tensors are values
    values = checkpoint_values(bare)
    assert sorted(values) == ["epoch", "w"] and torch.equal(values["w"], torch.zeros(3))
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.save({"optimizer": opt.state_dict(), "step": 1}, tmp_path / "opt.pt")
    assert checkpoint_values(tmp_path / "opt.pt") == {"step": 1}  # an optimizer's state is no value
    (tmp_path / "dir").mkdir()
    with pytest.raises(SpeedupsError, match=r"a directory, but not an FSDP2 checkpoint \(no .metadata"):
        checkpoint_values(tmp_path / "dir")


def test_strict_false_that_loads_nothing_and_a_path_in_the_wrong_place_are_errors(tmp_path) -> None:
    save_checkpoint(tmp_path / "ckpt.pt", model=nn.Linear(4, 8))
    with pytest.raises(SpeedupsError, match=r"strict=False: none of model's 2 entries is in the checkpoint"):
        load_checkpoint(tmp_path / "ckpt.pt", model=nn.Linear(3, 3), strict=False)
    with pytest.raises(TypeError, match=r"save_checkpoint\(path=Linear.*expected the checkpoint's file name"):
        save_checkpoint(nn.Linear(2, 1), tmp_path / "x.pt")

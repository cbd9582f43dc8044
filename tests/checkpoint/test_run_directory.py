"""RunDirectory: periodic saves (by updates, by the clock at window boundaries), the last K kept and never the
only good one deleted, the newest complete checkpoint resumed (a cut one skipped with a warning), a fresh
directory a new run, a stop on a signal saving mid-window, and the bad arguments refused. A run interrupted
and resumed through it equals the run that never stopped (torch.equal)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
import torch

from speedups import RunDirectory, SpeedupsError, SpeedupsWarning, checkpoint_values
from speedups.checkpoint import file_format
from speedups.checkpoint import run_directory as run_directory_module
from tests._dist import WORKERS, run_torchrun
from tests._elastic import EPOCHS, build


def _train(path: Path, *, stop_after: int | None = None, signal_at: int | None = None, **options) -> dict:
    """2 epochs of tests/_elastic.py's run with accumulate(2) through a RunDirectory; ``stop_after``
    micro-steps, the run "crashes" (nothing more is saved); ``signal_at``, SIGUSR2 is sent to this process."""
    state = build(2)
    step = state["step"]
    options.setdefault("stop_on", ["SIGUSR2"])
    run = RunDirectory(path, **options)
    try:
        values = run.resume(**state)
        for epoch in range(values.get("epoch", 0), EPOCHS):
            for x, y in step.epoch(state["loader"]):
                step(x, y)
                if step.step == signal_at:
                    os.kill(os.getpid(), signal.SIGUSR2)
                run.after_step(epoch=epoch)
                if step.step == stop_after:
                    return {"stopped": step.step}
    finally:
        if run.stop is not None:  # a stop's exit keeps its handler to the end of the process: not here
            run.stop.close()
    run.close()
    return {"weights": [p.detach().clone() for p in state["model"].parameters()], "run": run, "step": step}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_a_fresh_directory_starts_a_new_run_and_keeps_the_last_three(tmp_path: Path) -> None:
    plain = _train(tmp_path / "none", every_updates=None, stop_on=None)  # saves nothing
    assert _files(tmp_path / "none") == []
    done = _train(tmp_path / "run", every_updates=2, keep=3)  # 12 updates: a save every 2
    assert _equal(done, plain)  # saving changes nothing
    assert _files(tmp_path / "run") == ["ckpt-000003.pt", "ckpt-000004.pt", "ckpt-000005.pt"]
    assert done["run"].latest == tmp_path / "run" / "ckpt-000005.pt"
    assert checkpoint_values(done["run"].latest) == {"epoch": 1}
    raw = torch.load(done["run"].latest, weights_only=True)
    assert raw["step"]["num_updates"] == 12 and raw["step"]["pending"] == 0  # saved at a boundary


def test_a_crashed_run_resumes_from_the_newest_and_skips_a_cut_one(tmp_path: Path) -> None:
    ref = _train(tmp_path / "ref", stop_on=None)
    path = tmp_path / "run"
    assert _train(path, every_updates=2, stop_after=17) == {"stopped": 17}  # saved after 2, 4, 6, 8 updates
    newest = path / "ckpt-000003.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # cut in half (a full disk)
    (path / ".ckpt-000004.pt.abcd.tmp").write_bytes(b"half a write")  # a write a crash cut short
    with pytest.warns(SpeedupsWarning, match=r"skipped '.*ckpt-000003.pt': it cannot be read whole"):
        resumed = _train(path, every_updates=2)
    assert _equal(resumed, ref)
    assert not (path / ".ckpt-000004.pt.abcd.tmp").exists()
    assert resumed["run"].latest.name == "ckpt-000006.pt"  # from number 4 (after every name seen) on


def test_a_signal_saves_mid_window_and_exits_and_the_resume_is_exact(tmp_path: Path) -> None:
    ref = _train(tmp_path / "ref", stop_on=None)
    path = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        _train(path, every_updates=4, signal_at=11)  # mid-window: 1 of 2 micro-steps
    assert exited.value.code == 75
    raw = torch.load(path / "ckpt-000001.pt", weights_only=True)  # after the periodic one at 4 updates
    assert raw["step"]["step"] == 11 and raw["step"]["pending"] == 1
    assert _equal(_train(path, every_updates=4), ref)


def test_a_signal_before_the_first_checkpoint_and_one_during_a_save_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _train(tmp_path / "ref", stop_on=None)
    path = tmp_path / "run"
    with pytest.raises(SystemExit):
        _train(path, every_updates=100, signal_at=1)  # no checkpoint yet
    assert _files(path) == ["ckpt-000000.pt"]
    real = file_format.write

    def interrupted(target: Path, payload: dict) -> None:  # the signal arrives in the middle of a write
        os.kill(os.getpid(), signal.SIGUSR2)
        real(target, payload)

    monkeypatch.setattr(file_format, "write", interrupted)
    with pytest.raises(SystemExit):
        _train(path, every_updates=2)  # the periodic save at 2 updates is interrupted; then the stop's
    monkeypatch.setattr(file_format, "write", real)
    names = _files(path)
    assert names == ["ckpt-000000.pt", "ckpt-000001.pt", "ckpt-000002.pt"], names
    for name in names:
        checkpoint_values(path / name)  # every one reads whole
    assert _equal(_train(path, every_updates=2), ref)


def test_the_clock_saves_at_the_next_boundary_and_a_failed_write_keeps_the_last_good_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [0.0]

    def fake_monotonic() -> float:  # 20 s per call of the clock
        clock[0] += 20.0
        return clock[0]

    monkeypatch.setattr(run_directory_module.time, "monotonic", fake_monotonic)
    done = _train(tmp_path / "run", every_minutes=1, keep=1)
    raw = torch.load(done["run"].latest, weights_only=True)
    assert raw["step"]["pending"] == 0  # the clock's saves wait for a window boundary
    path = tmp_path / "fail"

    def full_disk(target: Path, payload: dict) -> None:
        if target.name != "ckpt-000000.pt":
            raise OSError(28, "No space left on device")
        file_format.write.__wrapped__(target, payload)  # type: ignore[attr-defined]

    full_disk.__wrapped__ = file_format.write  # type: ignore[attr-defined]
    monkeypatch.setattr(file_format, "write", full_disk)
    with pytest.raises(SpeedupsError, match="No space left on device"):
        _train(path, every_updates=2, keep=1)
    assert _files(path) == ["ckpt-000000.pt"]  # keep=1, yet the only good one stays
    checkpoint_values(path / "ckpt-000000.pt")


def test_bad_arguments_and_misuse_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"every_updates=0"):
        RunDirectory(tmp_path, every_updates=0)
    with pytest.raises(ValueError, match=r"keep=0"):
        RunDirectory(tmp_path, keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file; pass a directory"):
        RunDirectory(tmp_path / "file")
    run = RunDirectory(tmp_path / "run", stop_on=None)
    with pytest.raises(SpeedupsError, match=r"call run.resume\(model=..., optimizer=..., ...\) first"):
        run.after_step(epoch=0)
    with pytest.raises(TypeError, match=r"plain values are saved by after_step"):
        run.resume(model=torch.nn.Linear(2, 1), epoch=3)
    assert run.resume(model=torch.nn.Linear(2, 1)) == {}


def test_a_run_that_fits_none_of_its_checkpoints_raises_and_deletes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _train(path, every_updates=2, keep=2)  # accumulate(2) x batch 4
    before = _files(path)
    state = build(4)  # accumulate(4) x batch 4: another global batch, which no checkpoint of this run fits
    with (
        pytest.warns(SpeedupsWarning, match="cannot continue on this layout"),
        pytest.raises(
            SpeedupsError,
            match=r"none of its checkpoints can continue on this layout; the newest says: .*"
            r"Keep 8: decorate the step with accumulate\(2, ...\)",
        ),
    ):
        RunDirectory(path, stop_on=None).resume(**state)
    assert _files(path) == before


def test_misuse_of_after_step_values_and_resume_is_refused_at_once(tmp_path: Path) -> None:
    state = build(2)
    run = RunDirectory(tmp_path / "run", every_updates=1000, stop_on=None)
    run.resume(**state)
    with pytest.raises(ValueError, match=r"after_step\(step=...\): \['step'\] name objects given to resume"):
        run.after_step(step=3)  # the first call: long before any save
    with pytest.raises(TypeError, match=r"objects with state are given once, to run.resume\(tracker=tracker"):
        run.after_step(tracker=state["tracker"])
    with pytest.raises(SpeedupsError, match=r"resume\(\): called a second time"):
        run.resume(**state)
    with pytest.raises(ValueError, match=r"lies under the file"):
        (tmp_path / "afile").write_text("x")
        RunDirectory(tmp_path / "afile" / "run")
    with pytest.raises(
        ValueError, match=r"RunDirectory\(.*stop_on=\['SIGSEGV'\]\): stop_on: SIGSEGV is not a signal"
    ):
        RunDirectory(tmp_path / "x", stop_on=["SIGSEGV"])


def test_checkpoints_named_by_hand_are_found_by_their_number(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _train(path, every_updates=6, keep=1)  # one checkpoint left: ckpt-000001.pt at the end
    (path / "ckpt-000001.pt").rename(path / "ckpt-7.pt")  # copied in by hand, unpadded
    state = build(2)
    run = RunDirectory(path, stop_on=None)
    assert run.resume(**state) == {"epoch": 1} and run.latest == path / "ckpt-7.pt"


def test_a_second_writer_of_the_directory_is_refused_before_anything_changes(tmp_path: Path) -> None:
    path = tmp_path / "run"
    first = RunDirectory(path, every_updates=1, stop_on=None)
    first.resume(model=torch.nn.Linear(2, 1))
    first.save(epoch=0)
    (path / ".ckpt-000001.pt.abc123.tmp").write_bytes(b"x")  # first's write in flight, no leftover
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    held = f"{os.getpid()}\n{socket.gethostname()}\n".encode()
    assert before["run.lock"] == held  # held while the run lives
    second = RunDirectory(path, every_updates=1, stop_on=None)  # the same job, started twice
    with pytest.raises(
        SpeedupsError,
        match=rf"RunDirectory\('{path}'\)\.resume\(\): '{path}' is taken: another RunDirectory of this "
        rf"process \({os.getpid()}\) writes it\. .*overwrite each other's.*first_run\.close\(\).*"
        rf"RunDirectory\('{path}-2', \.\.\.\)",
    ):
        second.resume(model=torch.nn.Linear(2, 1))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # nothing changed, nothing removed
    with pytest.raises(SpeedupsError, match=r"call run\.resume\(model=..., optimizer=..., ...\) first"):
        second.after_step(epoch=0)  # the refused one is not bound: it cannot save either
    first.close()
    assert not (path / "run.lock").exists()  # let go at close
    bad = RunDirectory(path, stop_on=None)
    with pytest.raises(SpeedupsError, match=r"size mismatch|shape"):
        bad.resume(model=torch.nn.Linear(3, 1))  # a failed resume lets the directory go at once
    again = RunDirectory(path, every_updates=1, stop_on=None)  # after close(), in the same process
    assert again.resume(model=torch.nn.Linear(2, 1)) == {"epoch": 0}
    assert again.save(epoch=5) == path / "ckpt-000001.pt"
    with pytest.raises(SpeedupsError, match=r"save\(\) after close\(\): .* is taken: another RunDirectory"):
        first.save(epoch=1)  # the closed object does not write while another holds the directory
    again.close()
    assert first.save(epoch=1) == path / "ckpt-000002.pt"  # the same object after close(): numbered after
    assert checkpoint_values(path / "ckpt-000001.pt") == {"epoch": 5}  # again's, not overwritten
    first.close()
    assert sorted(p.name for p in path.iterdir()) == ["ckpt-000000.pt", "ckpt-000001.pt", "ckpt-000002.pt"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_hold_their_directory_through_rank_0_and_both_refuse_a_second_writer(
    tmp_path: Path,
) -> None:
    out = run_torchrun(WORKERS / "run_directory_ranks.py", [str(tmp_path / "run")], nproc=2, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    said = [line.split() for line in out.stdout.splitlines() if line.startswith("rank")]
    assert sorted(fields[0] for fields in said) == ["rank0", "rank1"]
    by_rank = {fields[0]: fields[1:] for fields in said}
    writer = by_rank["rank0"][0]  # rank 0's process id
    assert by_rank["rank1"][0] != writer
    for _pid, lock, second, third in by_rank.values():
        assert lock == f"lock={writer}"  # one hold, rank 0's (the writer's), seen from both ranks
        assert second == "second=refused"  # on every rank: none goes on alone, none hangs
        assert third == "third={'epoch':0}"  # once the first closed, a new one takes the directory
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt-000000.pt", "ckpt-000001.pt"]

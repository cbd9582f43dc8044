"""Background saves: the loop waits for a host copy of the state; the file is written in a thread, the
previous checkpoint stays intact until the new one is complete, the next save (and any load) waits for the
write, a failed write is raised by the next save, and the interpreter waits for the write at exit."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from speedups import SpeedupsError, accumulate, checkpoint_values, load_checkpoint, save_checkpoint
from speedups.checkpoint import background, file_format
from tests._bench import run_quick
from tests._dist import ROOT, _env


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step = accumulate(2, opt)(lambda x: model(x).square().mean())
    for _ in range(steps):
        step(torch.randn(5, 4))
    return model, opt, step


class _Gate:
    """Holds every background write until opened; records the order of the writes' starts and ends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open, self.events = threading.Event(), []
        real = file_format.write

        def held(path: Path, payload: dict) -> None:
            self.events.append(("start", path.name))
            if threading.current_thread() is not threading.main_thread():
                assert self.open.wait(30)
            real(path, payload)
            self.events.append(("end", path.name))

        monkeypatch.setattr(file_format, "write", held)


def test_the_file_holds_the_state_at_the_save_not_what_training_did_afterwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    model, opt, step = _trained()
    at_save = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]  # mid-window: the pending gradients are saved
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, background=True)
    for _ in range(4):  # training goes on while the file is written: 2 more updates, in place
        step(torch.randn(5, 4))
    gate.open.set()
    background.wait()
    assert not (tmp_path / ".c.pt").exists() and "background" not in checkpoint_values(tmp_path / "c.pt")
    fresh, fresh_opt, fresh_step = _trained(0)
    load_checkpoint(tmp_path / "c.pt", model=fresh, optimizer=fresh_opt, step=fresh_step)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), at_save, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(fresh.parameters(), grads, strict=True))
    assert fresh_step.pending == 1 and fresh_step.num_updates == 1


def test_the_previous_file_stays_until_the_new_one_is_complete_and_saves_run_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.pt"
    save_checkpoint(
        path, model=nn.Linear(2, 1), epoch=1
    )  # the previous checkpoint, written in the foreground
    gate = _Gate(monkeypatch)
    save_checkpoint(path, model=nn.Linear(2, 1), epoch=2, background=True)
    held = torch.load(path, weights_only=True)  # (checkpoint_values would wait for the write)
    assert held["epoch"] == 1  # the write is held: the old file is whole and readable
    opener = threading.Timer(0.2, gate.open.set)
    opener.start()
    save_checkpoint(tmp_path / "d.pt", model=nn.Linear(2, 1), epoch=3, background=True)  # waits for c.pt
    opener.join()
    assert gate.events[:3] == [("start", "c.pt"), ("end", "c.pt"), ("start", "d.pt")]
    assert load_checkpoint(path) == {"epoch": 2} and checkpoint_values(tmp_path / "d.pt") == {"epoch": 3}
    assert gate.events[-1] == ("end", "d.pt")  # load_checkpoint waited for the write in flight


def _frozen(value: object) -> object:
    """A deep copy of a state (tensors cloned), to compare bit for bit with :func:`_same` later."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_frozen(v) for v in value]
    return value


def _same(a: object, b: object) -> bool:
    """Whether two states are equal bit for bit (tensors: same dtype, shape and values; lists = tuples)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.layout != b.layout:
            return False
        if a.layout != torch.strided:  # sparse: the same indices and values
            a, b = a.coalesce(), b.coalesce()
            return _same([a.indices(), a.values()], [b.indices(), b.values()])
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _loop_state(model: nn.Module, opt: torch.optim.Optimizer, step: object) -> dict:
    """What the loop holds: weights, pending gradients, optimizer and step state, frozen."""
    grads = [None if p.grad is None else p.grad for p in model.parameters()]
    return _frozen(
        {
            "model": model.state_dict(),
            "grads": grads,
            "optimizer": opt.state_dict(),
            "step": step.state_dict(),
        }
    )


def test_each_background_file_holds_its_own_save_while_the_write_before_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Save A is held in its thread; the weights change; save B is issued and must wait for A before it
    copies (the host buffers A is writing from are the ones B reuses). The gate opens exactly when the loop
    waits for the write in flight, so a copy taken before that wait (or with no wait) lands in A's file."""
    gate = _Gate(monkeypatch)
    release_on_wait = threading.Event()
    real_wait = background.wait

    def waiting() -> None:  # the loop now waits for the held write: let it finish
        if release_on_wait.is_set():
            gate.open.set()
        real_wait()

    monkeypatch.setattr(background, "wait", waiting)
    model, opt, step = _trained(4)  # 2 updates, at a window boundary
    a = _loop_state(model, opt, step)
    save_checkpoint(tmp_path / "a.pt", model=model, optimizer=opt, step=step, background=True)
    assert _same(_loop_state(model, opt, step), a)  # the save changed nothing of the loop's
    for _ in range(3):  # 1 update and 1 pending micro-step while a.pt is held
        step(torch.randn(5, 4))
    assert gate.events == [("start", "a.pt")]  # a.pt is held
    b = _loop_state(model, opt, step)
    release_on_wait.set()
    save_checkpoint(tmp_path / "b.pt", model=model, optimizer=opt, step=step, background=True)
    assert _same(_loop_state(model, opt, step), b)
    assert not _same(a["model"], b["model"]) and not _same(a["optimizer"], b["optimizer"])
    assert b["step"]["pending"] == 1 and a["step"]["pending"] == 0
    gate.open.set()  # (code that never waited for a.pt has not opened the gate yet)
    real_wait()
    for name, moment in (("a.pt", a), ("b.pt", b)):
        held = torch.load(tmp_path / name, weights_only=True)
        for key in ("model", "optimizer", "step"):
            assert _same(held[key], moment[key]), f"{name}[{key!r}] is not the state at its save"
    assert [e for e in gate.events if e[0] == "start"] == [("start", "a.pt"), ("start", "b.pt")]
    assert gate.events.index(("end", "a.pt")) < gate.events.index(("start", "b.pt"))
    assert _same(_loop_state(model, opt, step), b)  # the writes changed nothing of the loop's either
    fresh, fresh_opt, fresh_step = _trained(0)
    load_checkpoint(tmp_path / "a.pt", model=fresh, optimizer=fresh_opt, step=fresh_step)
    assert _same(_loop_state(fresh, fresh_opt, fresh_step)["model"], a["model"])


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_sparse_state_is_written_in_the_background_as_it_was_at_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sparse embedding's pending gradient (and a sparse buffer) went through a dense host buffer:
    ``copy_() between dense and sparse Tensors is not implemented``, raised on rank 0 alone."""
    gate = _Gate(monkeypatch)
    torch.manual_seed(0)
    model = nn.Embedding(10, 3, sparse=True)
    model.register_buffer("mask", torch.eye(3).to_sparse())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = accumulate(2, opt)(lambda i: model(i).square().sum())
    step(torch.tensor([1, 2]))  # mid-window: the pending gradient is sparse
    moment = _loop_state(model, opt, step)
    assert moment["step"]["grads"][0].layout == torch.sparse_coo
    save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=step, background=True)
    for _ in range(3):  # an update and another pending gradient while the write is held
        step(torch.tensor([2, 5]))
    gate.open.set()
    background.wait()
    held = torch.load(tmp_path / "c.pt", weights_only=True)
    assert all(_same(held[key], moment[key]) for key in ("model", "step"))
    assert not _same(_loop_state(model, opt, step)["model"], moment["model"])


def test_a_failed_background_write_is_said_at_once_and_raised_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def full_disk(path: Path, payload: dict) -> None:
        raise OSError(28, "No space left on device")

    real = file_format.write
    monkeypatch.setattr(file_format, "write", full_disk)
    save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1), background=True)  # returns: the write is later
    background.wait()
    assert "speedups: a checkpoint could not be written: OSError" in capfd.readouterr().err  # said at once
    monkeypatch.setattr(file_format, "write", real)
    before = r"the checkpoint before, written in the background, failed \(OSError: .*No space left on device"
    with pytest.raises(
        SpeedupsError, match=before + r" \(writing '.*c.pt' in the background\)\); this one was"
    ):
        save_checkpoint(tmp_path / "d.pt", model=nn.Linear(2, 1))
    assert (tmp_path / "d.pt").exists()  # this save itself was written; the error was the one before
    save_checkpoint(tmp_path / "e.pt", model=nn.Linear(2, 1))  # reported once


def test_bad_background_argument_and_a_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"background=1.*expected True or False"):
        save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1), background=1)
    assert not (tmp_path / "c.pt").exists()
    with pytest.raises(
        SpeedupsError, match=r"could not write the checkpoint \(IsADirectoryError: .* directory"
    ):
        save_checkpoint(tmp_path, model=nn.Linear(2, 1), background=True)  # at once, not in the thread


def test_checkpoint_values_waits_for_a_background_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate(monkeypatch)
    save_checkpoint(tmp_path / "c.pt", model=nn.Linear(2, 1), epoch=2, background=True)
    threading.Timer(0.2, gate.open.set).start()
    assert checkpoint_values(tmp_path / "c.pt") == {"epoch": 2}  # not FileNotFoundError: it waited


@pytest.mark.slow
def test_the_interpreter_waits_for_the_write_at_exit(tmp_path: Path) -> None:
    code = (
        "import sys, time, torch\n"
        "from speedups import save_checkpoint\n"
        "from speedups.checkpoint import file_format\n"
        "real = file_format.write\n"
        "def slow(path, payload):\n"
        "    time.sleep(1.0)\n"
        "    real(path, payload)\n"
        "file_format.write = slow\n"
        f"save_checkpoint({str(tmp_path / 'c.pt')!r}, model=torch.nn.Linear(64, 64), epoch=7,\n"
        "                background=True)\n"
        "print('returned', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(None), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "returned" in done.stdout, done.stderr
    assert checkpoint_values(tmp_path / "c.pt") == {"epoch": 7}


@pytest.mark.slow
def test_the_benchmark_prints_its_line() -> None:
    stdout = run_quick("checkpointing")
    assert re.search(
        r"checkpointing: background save stalls the loop \d+\.\d\dx of a synchronous save", stdout
    )

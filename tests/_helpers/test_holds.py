"""One writer per path (speedups._helpers.holds): a second holder refused, in this process or another, and
named; a killed holder's path free at once, even while children it forked (os.fork, DataLoader workers) live;
a forked child never removes its parent's lock file nor writes its parent's buffered rows."""

from __future__ import annotations

import contextlib
import csv
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from speedups import MetricLogger, RunDirectory, SpeedupsError
from speedups._helpers.holds import PathHold
from tests._dist import ROOT


def _clash(holder: int | None) -> str:
    return f"taken by {holder}"


def test_a_second_holder_in_this_process_is_refused_and_a_released_or_collected_one_frees_it(
    tmp_path: Path,
) -> None:
    lock = tmp_path / "x.lock"
    first, second = PathHold(lock, _clash), PathHold(lock, _clash)
    first.acquire()
    first.acquire()  # held: nothing to do
    assert first.held and lock.read_text() == f"{os.getpid()}\n{socket.gethostname()}\n"
    with pytest.raises(SpeedupsError, match=rf"^taken by {os.getpid()}$"):
        second.acquire()  # a POSIX lock would let this process take it twice: the registry refuses it
    assert first.held and not second.held
    first.release()
    assert not lock.exists()
    second.acquire()
    del second  # dropped without release(): collected, it lets go
    gc.collect()
    assert not lock.exists()
    first.acquire()  # the same object, again after its release
    assert first.held
    first.release()


# A writer in its own process takes its directory, forks a child that outlives it (os.fork, or a DataLoader's
# workers stuck in a slow __getitem__), prints the pids and waits to be killed.
_WRITER = """
import os, sys, time, torch
from torch.utils.data import DataLoader, Dataset
from speedups import MetricLogger, RunDirectory

writer, fork, folder = sys.argv[1:]
if writer == "MetricLogger":
    held = MetricLogger(folder, sinks=["csv", "jsonl"], every=1)
    held.log(0, loss=1.0)
else:
    held = RunDirectory(folder, every_updates=1, stop_on=None)
    held.resume(model=torch.nn.Linear(2, 1))

class Slow(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        time.sleep(120); return torch.zeros(1)

def say(line): os.write(1, (line + "\\n").encode())  # one write: the lines of several processes never mix

if fork == "os.fork":
    if os.fork() == 0:
        say(f"child {os.getpid()}")
        time.sleep(120)
        os._exit(0)
else:
    loader = DataLoader(Slow(), batch_size=1, num_workers=2,
                        worker_init_fn=lambda _: say(f"child {os.getpid()}"))
    batches = iter(loader)  # the workers start, each stuck in __getitem__
say("ready")
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("fork", ["os.fork", "DataLoader workers"])
@pytest.mark.parametrize("writer", ["MetricLogger", "RunDirectory"])
def test_a_killed_writers_path_is_free_at_once_while_the_children_it_forked_live(
    tmp_path: Path, writer: str, fork: str
) -> None:
    folder = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WRITER), writer, fork, str(folder)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        assert process.stdout is not None
        ready, wanted = False, 1 if fork == "os.fork" else 2
        while not ready or len(children) < wanted:
            line = process.stdout.readline()
            assert line, "the writer ended before it was ready"
            if line.startswith("child"):
                children.append(int(line.split()[1]))
            ready = ready or line.strip() == "ready"
        with pytest.raises(
            SpeedupsError, match=rf"is taken: another {writer} writes it \(process {process.pid}"
        ):
            _take(writer, folder)  # the writer lives: refused, naming it
        process.kill()  # SIGKILL: no cleanup runs
        process.wait()
        taken = _take(writer, folder)  # at once: no retry, no wait
        for child in children:
            os.kill(child, 0)  # the orphaned children still live (ProcessLookupError otherwise)
        lock = folder / ("metrics.csv.lock" if writer == "MetricLogger" else "run.lock")
        assert lock.read_text() == f"{os.getpid()}\n{socket.gethostname()}\n"
        taken.close()
    finally:
        process.kill()
        process.wait()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def _take(writer: str, folder: Path) -> MetricLogger | RunDirectory:
    if writer == "MetricLogger":
        return MetricLogger(folder, sinks=["csv", "jsonl"])
    run = RunDirectory(folder, every_updates=1, stop_on=None)
    run.resume(model=torch.nn.Linear(2, 1))
    return run


_CHILD_EXITS = """
import os, sys
from speedups import MetricLogger

logger = MetricLogger(sys.argv[1], every=1)
for step in range(20):
    logger.log(step, loss=float(step))  # written to the file's buffer, not flushed yet
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit hooks and the flush of every open file run in the child
os.waitpid(pid, 0)
print("lock kept" if os.path.exists(os.path.join(sys.argv[1], "metrics.csv.lock")) else "lock removed")
logger.close()
"""


@pytest.mark.slow
def test_a_forked_child_that_exits_neither_removes_the_parents_lock_nor_writes_its_rows(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD_EXITS), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lock", "kept"]  # removed, a third writer could take the path meanwhile
    with open(tmp_path / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == list(range(20))  # each row once: the child's copy of the buffer went to /dev/null


_BARE_HOLD = """
import os, sys, time
from pathlib import Path
from speedups._helpers.holds import PathHold, fork_guard

hold = PathHold(Path(sys.argv[1]), lambda pid: f"taken by {pid}")
hold.acquire()
fork_guard._FILES.clear()  # the child keeps its copy of the descriptor: only the lock's kind is tested
if os.fork() == 0:
    os.write(1, f"child {os.getpid()}\\n".encode())
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


@pytest.mark.slow
def test_the_hold_itself_is_never_held_by_a_forked_child_that_keeps_the_descriptor(tmp_path: Path) -> None:
    """The two defences apart: without the fork guard, the child shares the lock file's open file; an
    ``flock`` lock would stay with it after the holder is killed, a POSIX record lock goes with the holder."""
    lock = tmp_path / "x.lock"
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_BARE_HOLD), str(lock)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("child"), line
        child = int(line.split()[1])
        with pytest.raises(SpeedupsError, match=rf"^taken by {process.pid}$"):
            PathHold(lock, _clash).acquire()
        process.kill()
        process.wait()
        os.kill(child, 0)  # the child lives, with its copy of the descriptor
        taken = PathHold(lock, _clash)
        taken.acquire()  # at once
        assert taken.held
        taken.release()
    finally:
        process.kill()
        process.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


_CONTENDER = """
import sys
from pathlib import Path
from speedups._helpers.holds import PathHold
try:
    PathHold(Path(sys.argv[1]), lambda pid: f"taken by {pid}").acquire()
    print("taken")
except Exception as err:
    print(err)
"""


def _contend(lock: Path) -> str:
    """What a second process gets when it asks for ``lock``."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CONTENDER), str(lock)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["open and close", "copytree of the folder", "os.open and os.close"])
def test_the_hold_survives_its_holder_closing_another_descriptor_of_the_lock_file(
    tmp_path: Path, how: str
) -> None:
    """POSIX drops a process's record locks on a file when it closes any descriptor of that file: a backup
    of the run folder would let a second writer in. The open file's own lock stays with the holder."""
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / "run.lock"
    hold = PathHold(lock, _clash)
    hold.acquire()
    try:
        assert _contend(lock) == f"taken by {os.getpid()}"
        if how == "open and close":
            lock.read_text()
        elif how == "copytree of the folder":
            shutil.copytree(folder, tmp_path / "backup")
        else:
            os.close(os.open(lock, os.O_RDONLY))
        assert _contend(lock) == f"taken by {os.getpid()}"  # still refused, naming the holder
        assert hold.held
    finally:
        hold.release()
    assert _contend(lock) == "taken"  # released: free at once

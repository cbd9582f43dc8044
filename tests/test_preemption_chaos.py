"""examples/train_preemptible.py killed at random points and restarted, as a user's long run is: it must end
with the weights of the run that was never stopped. On 2 processes, bit for bit, whatever the kill: SIGTERM to
the torchrun agent (every rank stops at one agreed micro-step and saves there), SIGKILL of one worker (the
job dies; the newest periodic checkpoint resumes), the newest checkpoint cut in half (skipped). Stopped on 2
processes x accumulate 2 and resumed on 1 x accumulate 4, and back, with dropout 0: to 1e-5.

The kill points are drawn at random in every run; a failure message names them (reproduce with
SPEEDUPS_CHAOS_SEED).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._dist import ROOT, _env, torchrun_command

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

EXAMPLE = ROOT / "examples" / "train_preemptible.py"
UPDATES = 48  # 96 micro-steps on 2 processes x accumulate 2
LANDS_WITHIN = 45  # micro-steps a SIGTERM to the agent may take to stop the run (~1 s: the agent, agreement)
SEED = int(os.environ.get("SPEEDUPS_CHAOS_SEED", time.time_ns() % 10**6))


def _run(run_dir: Path, *args: str, nproc: int = 2, kill_at: int | None = None, how: str = "") -> dict:
    """Run the example (under torchrun when ``nproc`` > 1); at micro-step ``kill_at`` do ``how``:
    ``agent`` (SIGTERM to the torchrun agent), ``worker`` (SIGKILL to one worker), ``term`` (SIGTERM to a
    single process's group). Returns its exit status, the micro-steps it printed and its stderr."""
    example = [str(EXAMPLE), "--run-dir", str(run_dir), "--updates", str(UPDATES), *args]
    cmd = torchrun_command(example[0], example[1:], nproc=nproc) if nproc > 1 else [sys.executable, *example]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(None), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    steps, resumed = [], None
    for line in proc.stdout:
        if line.startswith("resumed: micro_step="):
            resumed = int(line.split("=")[1])
        if not line.startswith("step "):
            continue
        steps.append(int(line.split()[2]))
        if kill_at is not None and steps[-1] == kill_at:
            kill_at = None
            if how == "agent":
                proc.send_signal(signal.SIGTERM)
            elif how == "term":
                os.killpg(proc.pid, signal.SIGTERM)
            else:  # the youngest worker process of the agent
                workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
                os.kill(int(workers.stdout.split()[-1]), signal.SIGKILL)
    stderr = proc.communicate(timeout=300)[1]
    return {"code": proc.returncode, "steps": steps, "resumed": resumed, "stderr": stderr}


def _final(run_dir: Path) -> dict:
    return torch.load(run_dir / "final.pt", weights_only=True)


def _distance(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_killed_anywhere_on_two_processes_it_ends_bit_for_bit_as_the_run_never_stopped(
    tmp_path: Path,
) -> None:
    draw = random.Random(SEED)
    ref = _run(tmp_path / "ref")
    assert ref["code"] == 0 and ref["steps"][-1] == 2 * UPDATES, ref["stderr"][-3000:]
    run_dir, kills, cut = tmp_path / "chaos", [], False
    last = 0  # the last micro-step the previous run printed
    for how in ("agent", "worker", "agent"):
        at = last + draw.randint(4, 14)
        if at > 2 * UPDATES - LANDS_WITHIN:  # too close to the end to be sure the kill lands first
            break
        kills.append((how, at))
        said = f"SPEEDUPS_CHAOS_SEED={SEED}, kills {kills}"
        got = _run(run_dir, kill_at=at, how=how)
        assert got["code"] != 0 and not (run_dir / "final.pt").exists(), f"{said}: the run was not stopped"
        if cut:
            assert "it cannot be read whole" in got["stderr"], f"{said}: the cut checkpoint was not skipped"
            cut = False
        if how == "agent":
            assert "stopping after the micro-step every rank agrees on" in got["stderr"], said
        else:  # the job died mid-run: also cut its newest checkpoint in half (a crash mid-copy, a full disk)
            newest = max(run_dir.glob("ckpt-*.pt"))
            newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
            cut = True
        last = got["steps"][-1]
    said = f"SPEEDUPS_CHAOS_SEED={SEED}, kills {kills}"
    done = _run(run_dir)
    assert done["code"] == 0 and done["resumed"] is not None, f"{said}: " + done["stderr"][-3000:]
    assert not cut or "it cannot be read whole" in done["stderr"], said
    distance = _distance(_final(run_dir), _final(tmp_path / "ref"))
    assert distance == 0, f"{said}: the final weights are {distance:.3e} away"


def test_stopped_on_two_processes_it_resumes_on_one_and_back_with_the_global_batch_kept(
    tmp_path: Path,
) -> None:
    draw = random.Random(SEED + 1)
    said = f"SPEEDUPS_CHAOS_SEED={SEED}"
    ref = _run(tmp_path / "ref", "--dropout", "0", "--accumulate", "2")  # 2 x 2 x 8 = 32 samples per update
    assert ref["code"] == 0, ref["stderr"][-3000:]
    two_to_one = tmp_path / "two-to-one"
    at = draw.randint(6, 2 * UPDATES - LANDS_WITHIN)
    got = _run(two_to_one, "--dropout", "0", "--accumulate", "2", kill_at=at, how="agent")
    assert got["code"] != 0 and "agrees on" in got["stderr"], f"{said}: SIGTERM at {at}"
    done = _run(two_to_one, "--dropout", "0", "--accumulate", "4", nproc=1)
    assert done["code"] == 0 and done["resumed"], f"{said}: " + done["stderr"][-3000:]
    assert _distance(_final(two_to_one), _final(tmp_path / "ref")) < 1e-5, f"{said}: stopped at {at}"
    one_to_two = tmp_path / "one-to-two"
    at = draw.randint(18, 4 * UPDATES - 8)  # one process stops at the next call; a periodic save at 16
    got = _run(one_to_two, "--dropout", "0", "--accumulate", "4", nproc=1, kill_at=at, how="term")
    assert got["code"] == 75, f"{said}: " + got["stderr"][-3000:]
    done = _run(one_to_two, "--dropout", "0", "--accumulate", "2")
    assert done["code"] == 0 and done["resumed"], f"{said}: " + done["stderr"][-3000:]
    assert _distance(_final(one_to_two), _final(tmp_path / "ref")) < 1e-5, f"{said}: stopped at {at}"

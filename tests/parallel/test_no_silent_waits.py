"""A collective of speedups called on some ranks only says so and fails at the timeout; rank 0 saves alone;
main_process_first orders the ranks; the rank helpers read the launcher.

No wall-clock upper bound here (a loaded machine stretches every duration): what is asserted is what
happens and in which order (a notice, then the failure; no notice where nothing waits), and the lower
bounds a timeout guarantees. The job's own limit, generous, only stops a hang.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from speedups import launch, local_rank, main_process_first, rank, world_size
from tests._dist import WORKERS, run_torchrun


def _run(mode: str, tmp_path: Path) -> tuple[list[dict], str]:
    out = run_torchrun(WORKERS / "one_rank_collectives.py", [mode, str(tmp_path)], nproc=2, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)], out.stderr


@pytest.mark.slow
@pytest.mark.distributed
def test_save_checkpoint_on_rank_0_only_saves_what_rank_0_holds_without_waiting(tmp_path: Path) -> None:
    results, stderr = _run("save_rank0", tmp_path)
    assert "still waiting" not in stderr and "gave up" not in stderr  # no rank waited on another
    assert all(r["error"] is None and r["result"]["values"] == {"iter_num": 2} for r in results)
    assert "other ranks' RNG states are not in the file" in results[0]["result"]["warned"][0]
    assert results[1]["result"]["warned"] == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mode", "calls"), [("save_rank1", "save_checkpoint"), ("tracker", "LossTracker.compute")]
)
def test_a_collective_on_one_rank_says_which_call_and_fails_at_the_timeout(
    tmp_path: Path, mode: str, calls: str
) -> None:
    results, stderr = _run(mode, tmp_path)
    errors = [r["error"] for r in results]
    assert all(e is not None and "gave up after 12 s" in e and "every rank must call it" in e for e in errors)
    assert any(e.startswith(f"{calls}() on rank") for e in errors)
    # said while waiting (10 s), before the failure (12 s): the notice names the call, the error the timeout
    assert "still waiting after 10 s" in stderr and f"{calls}() is collective" in stderr
    # never before the timeout: a lower bound, which load cannot break
    assert all(r["seconds"] > 10 for r in results)


def _ordered(_: object) -> tuple[float, float, int, int, int]:
    with main_process_first():
        start = time.monotonic()
        if rank() == 0:
            time.sleep(0.5)
        end = time.monotonic()
    return start, end, rank(), local_rank(), world_size()


@pytest.mark.slow
@pytest.mark.distributed
def test_main_process_first_runs_rank_0_before_the_others_and_rank_helpers_read_the_launch() -> None:
    (_, e0, *r0), (s1, _, *r1) = launch(_ordered, None, nprocs=2)
    assert s1 >= e0  # rank 1 began after rank 0 ended
    assert r0 == [0, 0, 2] and r1 == [1, 1, 2]


def test_one_process_runs_the_block_and_reads_rank_0_of_1() -> None:
    ran = []
    with main_process_first(local=True):
        ran.append(1)
    assert ran == [1] and (rank(), local_rank(), world_size()) == (0, 0, 1)
    refused = r"main_process_first\(local='yes'\): local='yes': expected True or False"
    with pytest.raises(TypeError, match=refused), main_process_first(local="yes"):  # type: ignore[arg-type]
        pass


def _first_fails(_: object) -> str:
    from speedups import SpeedupsError

    try:
        with main_process_first():
            if rank() == 0:
                raise ValueError("the cache could not be built")
            return "ran the block"
    except (ValueError, SpeedupsError) as err:
        return f"{type(err).__name__}: {err}"


@pytest.mark.slow
@pytest.mark.distributed
def test_when_the_first_rank_fails_the_others_raise_instead_of_running_the_block() -> None:
    first, other = launch(_first_fails, None, nprocs=2)
    assert first == "ValueError: the cache could not be built"
    assert other.startswith("SpeedupsError: main_process_first(local=False): the block failed on rank(s) [0]")

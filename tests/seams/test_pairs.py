"""The seam matrix: every pair of levers a user may combine, trained with speedups and by hand.

Each lever is exact alone; the faults that slip are where two meet with the defaults users get (persistent
workers and a dataset that changes, fast_kernels and a fused Adam, compile_blocks under inductor and
checkpointed blocks, an out-of-memory retry and batch norm). Each pair trains the small loop of
``loops.py`` both ways and compares the weights, buffers and losses within the pair's tolerance, and the
global RNG state exactly. The table is ``levers.py``; the docs' development page names the pairs.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import WORKERS, run_torchrun
from tests.seams.levers import LEVERS, Lever, pairs, recipe_of
from tests.seams.loops import differences, run_reference, run_speedups


def _case(levers: tuple[Lever, ...]) -> object:
    marks = [pytest.mark.slow] if any(lever.slow for lever in levers) else []
    return pytest.param(levers, marks=marks, id="+".join(lever.name for lever in levers))


CASES = [_case((lever,)) for lever in LEVERS] + [_case(pair) for pair in pairs()]


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    """One compute thread: the reference and speedups' loop run the same kernels in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("levers", CASES)
def test_the_pair_trains_as_the_hand_written_loop(levers: tuple[Lever, ...]) -> None:
    recipe = recipe_of(*levers)
    want = run_reference(recipe)
    got = run_speedups(recipe)
    tolerance = max(lever.tolerance for lever in levers)
    diff = differences(got, want)
    assert len(got.losses) == len(want.losses)
    assert all(value <= tolerance for value in diff.values()), (recipe, diff)


@pytest.mark.slow
@pytest.mark.distributed
def test_each_lever_beside_ddp_on_two_gloo_ranks_trains_as_the_hand_written_loop(tmp_path) -> None:
    out = run_torchrun(WORKERS / "seam_pairs_ddp.py", [str(tmp_path)], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split(" ", 3) for line in out.stdout.splitlines() if line.startswith("case ")]
    expected = ["ddp"] + [f"ddp+{lever.name}" for lever in LEVERS if lever.ddp]
    assert [line[1] for line in lines] == expected, out.stdout
    wrong = [" ".join(line[1:]) for line in lines if line[2] != "ok"]
    assert not wrong, wrong

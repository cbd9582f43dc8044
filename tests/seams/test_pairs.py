"""The seam matrix: every pair of levers a user may combine, trained with speedups and by hand.

Each lever is exact alone; the faults that slip are where two meet with the defaults users get (persistent
workers and a dataset that changes, fast_kernels and a fused Adam, compile_blocks under inductor and
checkpointed blocks, an out-of-memory retry and batch norm). Each pair trains the small loop of
``loops.py`` both ways and compares the weights, buffers and losses within the pair's tolerance, and the
global RNG state exactly. The table is ``levers.py``; the docs' development page names the pairs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import WORKERS, run_torchrun
from tests.seams.levers import EXCLUDED, LEVERS, Lever, pairs, recipe_of
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


def test_the_development_page_names_every_lever_of_the_matrix() -> None:
    """docs/development.md's table lists the levers of levers.py, with their tolerance, slowness and DDP."""
    page = (Path(__file__).parents[2] / "docs" / "development.md").read_text()
    section = page.split("## The seam matrix", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.split("|")[1:-1] for line in lines]
    listed = {cells[0].strip(): [c.strip() for c in cells[3:]] for cells in rows[1:]}
    listed = {name: [float(cells[0]), *cells[1:]] for name, cells in listed.items()}
    expected = {
        lever.name: [lever.tolerance, "yes" if lever.slow else "", "yes" if lever.ddp else ""]
        for lever in LEVERS
    }
    assert listed == expected
    for names in EXCLUDED:  # each pair left out is named in the text
        assert all(name in section for name in names)

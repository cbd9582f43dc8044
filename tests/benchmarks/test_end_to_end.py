"""The end-to-end benchmark in quick mode (its output's form, not its timings), and its results section."""

from __future__ import annotations

import re

import pytest
import torch

from tests._bench import run_quick

LAST_LINE = re.compile(
    r"end_to_end: speedups (\d+\.\d\d)x faster than before, (\d+\.\d\d)x of expert, "
    r"accelerate (\d+\.\d\dx|n/a), fabric (\d+\.\d\dx|n/a)"
)


@pytest.mark.slow  # a subprocess that trains five loops (about 20 s of CPU)
def test_quick_run_prints_every_row_and_the_headline_last(tmp_path) -> None:
    stdout = run_quick("end_to_end", timeout=400, results=tmp_path)
    lines = stdout.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    for row in ["before", "after", "expert", "accelerate", "fabric"]:
        # each row is timed, or says why it could not run
        assert any(re.match(rf"{row} +\d+\.\d\d s", line) for line in lines) or any(
            line.startswith(f"{row}: skipped: ") for line in lines
        ), (row, stdout)
    before = next(line for line in lines if line.startswith("before "))
    assert "1.00x" in before.split("s", 1)[1]  # before is the reference of its own ratio
    latest = (tmp_path / "latest.md").read_text()
    assert "## end_to_end\n\n```\n" in latest and lines[-1] in latest
    assert (tmp_path / "end_to_end.png").read_bytes()[:4] == b"\x89PNG"


def test_write_section_replaces_its_own_topic_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    from benchmarks import _timing

    monkeypatch.setattr(_timing, "RESULTS", tmp_path)
    (tmp_path / "latest.md").write_text(
        "# Benchmark results (full mode)\n\nstamp\n\n## accumulate\n\n```\nA\n```\n\n"
        "## end_to_end\n\n```\nold\n```\n\n## profiling\n\n```\nP\n```\n"
    )
    _timing.write_section("end_to_end", "new\nlines")
    text = (tmp_path / "latest.md").read_text()
    assert text.startswith("# Benchmark results (full mode)\n\nstamp\n")
    assert "old" not in text and "## end_to_end\n\n```\nnew\nlines\n```\n" in text
    assert text.index("## accumulate") < text.index("## end_to_end") < text.index("## profiling")
    assert "```\nA\n```" in text and "```\nP\n```" in text
    _timing.write_section("sharding", "S")  # a new topic joins in name order
    assert (tmp_path / "latest.md").read_text().rstrip().endswith("## sharding\n\n```\nS\n```")


def test_every_row_sees_the_same_stream_whatever_its_workers() -> None:
    """RaceSampler's keys fix the order and each item's augmentation, in any process, moving no other RNG."""
    from torch.utils.data import DataLoader

    from benchmarks._digits32 import AugmentedDigits, RaceSampler, encode_png

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 1, 64, 64), dtype=torch.uint8, generator=g)
    data = AugmentedDigits([encode_png(im) for im in images], torch.arange(6))
    sampler = RaceSampler(6, seed=3)
    orders = []
    for epoch in (0, 1, 0):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    assert orders[0] == orders[2] != orders[1]  # one order per (seed, epoch), however often it is read
    assert sorted(k % 6 for k in orders[1]) == list(range(6))
    assert sorted(orders[0]) == [3000 * 6 + i for i in range(6)]  # epoch 0 of seed 3

    sampler.set_epoch(1)
    state = torch.get_rng_state()
    alone = torch.stack([data[k][0] for k in sampler])
    assert torch.equal(torch.get_rng_state(), state)  # the global generator did not move
    main, workers = (
        torch.cat([x for x, _ in DataLoader(data, batch_size=4, sampler=sampler, num_workers=n)])
        for n in (0, 2)
    )
    assert torch.equal(main, alone) and torch.equal(workers, alone)
    assert not torch.equal(data[orders[0][0]][0], data[orders[0][0] + 6][0])  # another epoch, another draw

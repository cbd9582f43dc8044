"""The metrics benchmark's variants log the same values, and its read counts are what it prints."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from benchmarks.metrics import hand_written_csv, reads_per_call, with_metric_logger


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(steps)
    ]


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_metric_logger_reads_once_per_flush_where_the_hand_written_loop_reads_every_tensor(tmp_path) -> None:
    batches = _batches(100)
    assert reads_per_call(hand_written_csv, batches, tmp_path) == 3.0  # loss, accuracy, largest logit
    assert (
        reads_per_call(with_metric_logger, batches, tmp_path) == 2 / 100
    )  # every=50: two reads in 100 steps
    hand, ours = _rows(tmp_path / "hand0.csv"), _rows(tmp_path / "speedups0" / "metrics.csv")
    assert ours[0] == hand[0] and len(ours) == len(hand) == 101
    for mine, theirs in zip(ours[1:], hand[1:], strict=True):  # the same text: float64 written exactly
        assert [float(x) for x in mine] == [float(x) for x in theirs]

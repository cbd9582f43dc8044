"""gather(): per-sample outputs from every rank, each sample exactly once and in dataset order."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from speedups import SpeedupsError, distributed, gather, launch

Out = namedtuple("Out", ["logits", "index"])


def _data(n: int = 10) -> TensorDataset:
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1) * torch.tensor([[1.0, -2.0, 0.5]])
    return TensorDataset(x, torch.arange(n))


def _model(x: torch.Tensor) -> torch.Tensor:
    return x * 3.0 + 1.0  # per-sample outputs, shape (B, 3)


def _eval(loader) -> dict:
    """This rank's outputs for every sample its loader gave it, concatenated along dim 0."""
    logits, index = [], []
    for x, i in loader:
        logits.append(_model(x))
        index.append(i)
    return {"out": Out(torch.cat(logits), torch.cat(index))}


def _check(gathered: dict, data: TensorDataset, kept: int | None = None) -> None:
    x, idx = data.tensors
    n = len(idx) if kept is None else kept
    assert torch.equal(gathered["out"].index, idx[: len(gathered["out"].index)])  # dataset order, once each
    assert len(gathered["out"].index) == n
    torch.testing.assert_close(gathered["out"].logits, _model(x)[gathered["out"].index], rtol=0, atol=1e-6)


def _gather_worker() -> list[str]:
    """One process of a 3-process job: every combination of even and shuffle, 10 samples, two epochs."""
    data, done = _data(10), []
    for even in (True, False):
        for shuffle in (True, False):
            loader = distributed(DataLoader(data, batch_size=2, shuffle=shuffle), even=even, seed=3)
            for _ in range(2):  # the last pass counts; the second epoch's order differs from the first
                mine = _eval(loader)
            assert len(mine["out"].index) == (4 if even else (4 if torch.distributed.get_rank() == 0 else 3))
            _check(gather(mine, loader), data)
            done.append(f"even={even} shuffle={shuffle}")
    # Without a loader: the concatenation in rank order, lengths differing between ranks.
    rank = torch.distributed.get_rank()
    cat = gather(torch.full((rank + 1, 2), float(rank)))
    assert torch.equal(cat, torch.tensor([[0.0] * 2] + [[1.0] * 2] * 2 + [[2.0] * 2] * 3))
    return [*done, os.environ["RANK"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_gather_three_gloo_processes_ten_samples_exactly_once_in_dataset_order() -> None:
    results = launch(_gather_worker, nprocs=3)
    combos = [f"even={e} shuffle={s}" for e in (True, False) for s in (True, False)]
    assert results == [[*combos, str(r)] for r in range(3)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("even", [True, False])
def test_gather_in_one_process_restores_dataset_order(shuffle: bool, even: bool) -> None:
    data = _data(10)
    loader = distributed(DataLoader(data, batch_size=3, shuffle=shuffle), even=even, rank=0, world_size=1)
    _check(gather(_eval(loader), loader), data)


def test_gather_with_drop_last_keeps_only_the_samples_given() -> None:
    data = _data(10)
    loader = distributed(DataLoader(data, batch_size=4, drop_last=True), rank=0, world_size=1)
    mine = _eval(loader)
    assert len(mine["out"].index) == 8
    _check(gather(mine, loader), data, kept=8)


def test_gather_without_a_loader_in_one_process_is_the_input() -> None:
    x = {"a": torch.arange(4), "b": [torch.ones(4, 2)]}
    out = gather(x)
    assert torch.equal(out["a"], x["a"]) and torch.equal(out["b"][0], x["b"][0])


def test_gather_of_an_adopted_distributed_sampler_loader() -> None:
    data = _data(10)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = distributed(DataLoader(data, batch_size=4, sampler=sampler))
    _check(gather(_eval(loader), loader), data)


def test_gather_bad_input() -> None:
    data = _data(10)
    loader = distributed(DataLoader(data, batch_size=4), rank=0, world_size=1)
    with pytest.raises(SpeedupsError, match="has not run a pass yet"):
        gather(torch.zeros(10, 3), loader)
    _eval(loader)
    with pytest.raises(ValueError, match="x has 11 rows but the loader gave this rank 10"):
        gather(torch.zeros(11, 3), loader)
    with pytest.raises(ValueError, match=r"different row counts \[9, 10\]"):
        gather({"a": torch.zeros(10), "b": torch.zeros(9)})
    with pytest.raises(TypeError, match="every leaf must be a tensor"):
        gather([torch.zeros(2), "label"])
    with pytest.raises(TypeError, match="expected the loader made by distributed"):
        gather(torch.zeros(2), DataLoader(data))
    split = distributed(DataLoader(data, batch_size=4), rank=0, world_size=2)
    _eval(split)
    with pytest.raises(SpeedupsError, match="no process group is running"):
        gather(torch.zeros(5, 3), split)


def test_rows_that_do_not_match_the_loaders_pass_are_refused_both_ways() -> None:
    loader = distributed(DataLoader(_data(10), batch_size=4))
    x = torch.cat([_model(xb) for xb, _ in loader])
    assert gather(x, loader).shape == (10, 3)
    with pytest.raises(
        ValueError, match=r"x has 8 rows but the loader gave this rank 10 samples.*whole pass"
    ):
        gather(x[:8], loader)  # a loop that stopped early: its rows cannot be matched to samples
    dropping = distributed(DataLoader(_data(10), batch_size=4, drop_last=True))
    rows = torch.cat([_model(xb) for xb, _ in dropping])
    assert rows.shape[0] == 8 and torch.equal(gather(rows, dropping), rows)  # the dropped tail is no row


def test_gather_takes_the_loader_through_prefetch_to_device() -> None:
    from speedups import prefetch_to_device

    data = _data(10)
    loader = distributed(DataLoader(data, batch_size=3, shuffle=True), rank=0, world_size=1)
    ahead = prefetch_to_device(loader, "cpu")
    _check(gather(_eval(ahead), ahead), data)

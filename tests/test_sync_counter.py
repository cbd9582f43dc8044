"""The tests' own sync counter sees every kind of host read, once each, and no other op."""

from __future__ import annotations

import pytest
import torch

from tests._sync_counter import SyncCounter


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: t.tolist(),
        lambda t: float(t.sum()),
        lambda t: int(t[0]),
        lambda t: bool(t.sum() > 0),
        lambda t: t.numpy(),
    ],
    ids=["item", "tolist", "float", "int", "bool", "numpy"],
)
def test_each_read_counts_exactly_once(read) -> None:
    t = torch.arange(4.0)
    with SyncCounter() as counter:
        read(t)
    assert counter.count == 1


def test_several_reads_add_up_and_plain_ops_count_nothing() -> None:
    t = torch.arange(4.0, requires_grad=True)
    with SyncCounter() as counter:
        loss = (t * 2).pow(2).sum()
        loss.backward()
        t.detach().clone().mul_(3)
    assert counter.count == 0
    with SyncCounter() as counter:
        loss.item()
        t.tolist()
        if loss > 0:
            int(t[1])
    assert counter.count == 4


def test_device_only_leaves_cpu_reads_out() -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    with SyncCounter(device_only=True) as counter:
        opt.step()  # reads its CPU step counter
        torch.ones(3).tolist()
    assert counter.count == 0
    with SyncCounter() as counter:
        opt.step()
    assert counter.count == 2  # the same reads (one per parameter), counted when the CPU stands in


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t[t > 1],  # masked indexing
        lambda t: t.nonzero(),
        lambda t: torch.where(t > 1),  # the one-argument form is nonzero
        lambda t: t.masked_select(t > 1),
        lambda t: t.unique(),
        lambda t: t.bincount(),
        lambda t: torch.repeat_interleave(t),
        lambda t: t.index_put_((t > 1,), torch.tensor(0)),
    ],
    ids=["masked-index", "nonzero", "where", "masked_select", "unique", "bincount", "repeat", "masked-put"],
)
def test_ops_whose_size_depends_on_values_count_once_where_the_cpu_stands_in(read) -> None:
    t = torch.arange(4)
    with SyncCounter() as counter:
        read(t)
    assert counter.count == 1
    with SyncCounter(device_only=True) as counter:
        read(t)
    assert counter.count == 0
    with SyncCounter() as counter:
        t[1:3], t.index_select(0, torch.tensor([0, 2])), t.repeat_interleave(2), t[torch.tensor([0, 1])]
    assert counter.count == 0  # sizes known from the shapes: no read


@pytest.mark.cuda
@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),  # a device-to-host copy, no _local_scalar_dense
        lambda t: t.cpu(),
        lambda t: t[t > 1],  # masked indexing: torch reads the mask's count inside the op
        lambda t: t.nonzero(),
        lambda t: bool(t.sum() > 0),
    ],
    ids=["tolist", "cpu", "masked-index", "nonzero", "bool"],
)
def test_device_reads_count_once_on_a_gpu(read) -> None:
    t = torch.arange(4.0, device="cuda")
    with SyncCounter(device_only=True) as counter:
        read(t)
    assert counter.count == 1

"""check(): each mistake detector warns once on its mistake and stays silent on the correct loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from speedups import SpeedupsError, SpeedupsWarning, check, fast_loader
from tests._dist import free_port


def test_kept_graph_detector(model) -> None:
    batches = [torch.randn(4, 8) for _ in range(4)]
    losses = []
    with check() as chk, pytest.warns(SpeedupsWarning, match=r"losses.append\(loss.detach\(\)\)") as record:
        for x in chk.iter(batches):
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(loss)  # the mistake: keeps every step's graph
    assert len([w for w in record if "autograd graph" in str(w.message)]) == 1  # warns once

    losses.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        with check() as chk:
            for x in chk.iter(batches):
                loss = model(x).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())


@pytest.mark.parametrize("made_by", ["DataLoader", "fast_loader"])
def test_sampler_epoch_detector(made_by: str) -> None:
    """fast_loader's workers persist: its loader.sampler wraps the DistributedSampler, which is found."""
    data = list(range(20))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    if made_by == "DataLoader":
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    else:
        loader = fast_loader(data, 4, sampler=sampler, num_workers=1)
        assert loader.persistent_workers and loader.sampler.sampler is sampler
    with check() as chk, pytest.warns(SpeedupsWarning, match=r"set_epoch\(epoch\)"):
        for _ in range(2):  # the mistake: no set_epoch
            for _batch in chk.iter(loader):
                pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeedupsWarning)
        with check() as chk:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                for _batch in chk.iter(loader):
                    pass


def test_no_sync_detector_on_a_one_process_ddp() -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with check(model=ddp), pytest.warns(SpeedupsWarning, match="forward inside too"):
            loss = F.mse_loss(ddp(x), y)  # the mistake: forward outside no_sync
            with ddp.no_sync():
                loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", SpeedupsWarning)
            with check(model=ddp):
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
                F.mse_loss(ddp(x), y).backward()  # a synced micro-step: fine
        assert not ddp._forward_hooks  # the detector's hook is removed on exit
    finally:
        torch.distributed.destroy_process_group()


def test_a_checker_cannot_be_entered_twice(model) -> None:
    chk = check()
    with chk:
        with pytest.raises(SpeedupsError, match="already entered"), chk:
            pass
        # the refused entry left the outer one watching: its detector still warns
        losses = []
        with pytest.warns(SpeedupsWarning, match="autograd graph"):
            for x in chk.iter([torch.randn(4, 8) for _ in range(3)]):
                losses.append(model(x).pow(2).mean())
    with chk:  # once exited, it can be entered again
        pass
    with pytest.raises(TypeError, match=r"enabled='no'"):
        check(enabled="no")
    with pytest.raises(TypeError, match="model="):
        check(model="net")

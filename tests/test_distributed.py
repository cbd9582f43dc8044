"""Tip 9 in one process: the environment mapping, distributed(loader), ddp_wrap, rank-zero helpers.

Multi-process runs (real torchrun jobs) are in tests/test_distributed_jobs.py.
"""

from __future__ import annotations

import os
import random
import stat
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler

from speedups import (
    DistributedLoader,
    SpeedupsError,
    _env,
    ddp_wrap,
    default_device,
    distributed,
    init_distributed,
    is_main_process,
    rank_zero_only,
    rank_zero_print,
    seed_everything,
)


def _flat(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


# --------------------------------------------------------------------------------------------- A3: sampler
def test_a3_epochs_differ_ranks_disjoint_cover_all_agree_and_resume() -> None:
    base = DataLoader(list(range(20)), batch_size=4, shuffle=True)
    ranks = [distributed(base, rank=r, world_size=2) for r in (0, 1)]
    epochs = [[_flat(loader) for loader in ranks] for _ in range(2)]  # two passes, no set_epoch by hand
    for e in range(2):
        r0, r1 = epochs[e]
        assert len(r0) == len(r1) == 10 and not set(r0) & set(r1) and sorted(r0 + r1) == list(range(20))
    assert epochs[0][0] != epochs[1][0]
    # Both ranks agree on the permutation: it is torch's DistributedSampler with seed + epoch.
    for e in range(2):
        for r in (0, 1):
            ref = DistributedSampler(list(range(20)), num_replicas=2, rank=r, shuffle=True, seed=0)
            ref.set_epoch(e)
            assert epochs[e][r] == list(ref)
    # Resuming at epoch 1 replays epoch 1 exactly, on a fresh loader (set_epoch and state dict).
    fresh = distributed(base, rank=1, world_size=2)
    fresh.set_epoch(1)
    assert _flat(fresh) == epochs[1][1]
    again = distributed(base, rank=0, world_size=2)
    again.load_state_dict({"epoch": 1, "batches": 0, "world_size": 2, "rank": 0})
    assert _flat(again) == epochs[1][0] and again.epoch == 1


def test_mid_epoch_state_resumes_without_replay_or_skip() -> None:
    base = DataLoader(list(range(22)), batch_size=3, shuffle=True, drop_last=False)
    full = distributed(base, rank=1, world_size=2)
    _flat(full)  # epoch 0
    it = iter(full)  # epoch 1
    first = [next(it).tolist() for _ in range(2)]
    state = full.state_dict()
    assert state == {"epoch": 1, "batches": 2, "world_size": 2, "rank": 1}
    rest = [b.tolist() for b in it]
    assert full.state_dict() == {"epoch": 2, "batches": 0, "world_size": 2, "rank": 1}
    resumed = distributed(base, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert len(resumed) == len(rest)
    assert [b.tolist() for b in resumed] == rest and first + rest != rest
    other = distributed(base, rank=1, world_size=4)
    with pytest.raises(ValueError, match="world size 2, loaded with 4"):
        other.load_state_dict(state)


def test_even_false_gives_every_sample_exactly_once_without_padding() -> None:
    base = DataLoader(list(range(11)), batch_size=2, shuffle=True)
    padded = [_flat(distributed(base, rank=r, world_size=3)) for r in range(3)]
    assert sum(map(len, padded)) == 12  # even=True pads like DistributedSampler
    exact = [_flat(distributed(base, rank=r, world_size=3, even=False)) for r in range(3)]
    assert sorted(exact[0] + exact[1] + exact[2]) == list(range(11)) and [len(e) for e in exact] == [4, 4, 3]
    loaders = [distributed(base, rank=r, world_size=3, even=False) for r in range(3)]
    assert [len(loader) for loader in loaders] == [2, 2, 2]


def test_loader_settings_are_kept_and_the_original_untouched() -> None:
    def collate(batch):
        return torch.tensor(batch) * 10

    g = torch.Generator().manual_seed(5)
    base = DataLoader(list(range(9)), batch_size=2, shuffle=True, drop_last=True, collate_fn=collate,
                      generator=g, pin_memory=False)  # fmt: skip
    before = base.sampler
    dl = distributed(base, rank=0, world_size=2)
    assert isinstance(dl, DataLoader) and isinstance(dl, DistributedLoader)
    assert (dl.batch_size, dl.drop_last, dl.collate_fn, dl.generator, dl.pin_memory) == (
        2,
        True,
        collate,
        g,
        False,
    )
    assert isinstance(dl.sampler, DistributedSampler) and dl.sampler.rank == 0
    assert len(dl) == 2 and all(int(v) % 10 == 0 for v in _flat(dl))  # 5 samples, drop_last: 2 batches
    assert base.sampler is before and isinstance(base.sampler, RandomSampler)
    # The original's sampler inside a user BatchSampler: rebuilt around the DistributedSampler.
    user = DataLoader(list(range(10)), batch_sampler=BatchSampler(RandomSampler(range(10)), 3, False))
    dl2 = distributed(user, rank=1, world_size=2)
    assert isinstance(dl2.batch_sampler, BatchSampler) and dl2.batch_sampler.batch_size == 3
    assert isinstance(dl2.distributed_sampler, DistributedSampler) and dl2.distributed_sampler.shuffle
    assert [len(b) for b in dl2] == [3, 2]
    # shuffle=None keeps the original's choice; explicit shuffle overrides it.
    seq = DataLoader(list(range(8)), batch_size=2)
    assert _flat(distributed(seq, rank=0, world_size=2)) == [0, 2, 4, 6]
    assert distributed(seq, rank=0, world_size=2, shuffle=True).distributed_sampler.shuffle


def test_loader_with_workers_still_works() -> None:
    base = DataLoader(list(range(8)), batch_size=2, shuffle=True, num_workers=1, persistent_workers=True)
    dl = distributed(base, rank=0, world_size=2)
    assert dl.num_workers == 1 and dl.persistent_workers
    epochs = [_flat(dl), _flat(dl)]
    assert epochs[0] != epochs[1] or len(set(epochs[0])) == 4


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: distributed([1, 2, 3]), TypeError, r"distributed\(loader=list\): expected a torch"),
        (lambda: distributed(DataLoader(_Stream())), TypeError, r"IterableDataset.*get_worker_info"),
        (lambda: distributed(DataLoader(range(4), sampler=[0, 1])), TypeError, "sampler is a list"),
        (lambda: distributed(DataLoader(range(4), shuffle=True), rank=2, world_size=2), ValueError, "rank"),
        (lambda: distributed(DataLoader(range(4)), world_size=0), ValueError, "world_size=0"),
        (lambda: distributed(DataLoader(range(4)), even="no"), TypeError, "even='no'"),
        (lambda: distributed(distributed(DataLoader(range(4)))), ValueError, "already distributed"),
        (lambda: distributed(DataLoader(range(4), sampler=RandomSampler(range(4), replacement=True))),
         TypeError, "replacement"),
    ],
)  # fmt: skip
def test_distributed_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------- A8: environment
def _a8(monkeypatch) -> None:
    for key, value in {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_a8_device_from_local_rank_process_group_and_sampler_from_global_rank(monkeypatch) -> None:
    _a8(monkeypatch)
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    assert default_device() == torch.device("cuda", 1)
    assert init_distributed(timeout=60) is True
    init = calls["init"]
    assert init["rank"] == 5 and init["world_size"] == 8 and init["backend"] == "nccl"  # type: ignore[index]
    assert init["timeout"] == timedelta(seconds=60) and init["init_method"] is None  # type: ignore[index]
    assert calls["set_device"] == torch.device("cuda", 1)
    sampler = distributed(DataLoader(list(range(16)), batch_size=2, shuffle=True)).distributed_sampler
    assert (sampler.rank, sampler.num_replicas) == (5, 8)
    assert not is_main_process()  # logging and checkpoints: global rank 0 only
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")  # local rank 0 of the second node is not the main process
    assert not is_main_process()


def test_slurm_only_uses_tcp_init_with_the_first_node(monkeypatch) -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    for key, value in {**slurm, "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: parse the list
    calls: dict[str, dict] = {}
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    assert init_distributed() is True
    assert calls["init"]["init_method"] == "tcp://gpu07:29500" and calls["init"]["backend"] == "gloo"
    assert (calls["init"]["rank"], calls["init"]["world_size"]) == (3, 4)
    assert "MASTER_ADDR" not in os.environ  # nothing written to the environment


def test_master_addr_prefers_scontrol_when_present(monkeypatch, tmp_path: Path) -> None:
    script = tmp_path / "scontrol"
    script.write_text("#!/bin/sh\necho node-a\necho node-b\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _env.master_addr({"SLURM_NODELIST": "weird{1}"}) == "node-a"
    assert _env.master_addr({"SLURM_NODELIST": "n[2-3]", "MASTER_ADDR": "h"}) == "h"
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert _env.master_addr({"SLURM_NODELIST": "n[2-3]"}) == "n2" and _env.master_addr({}) == "127.0.0.1"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("gpu[03-05,09],cpu1", "gpu03"), ("a-b[1-2]-ib", "a-b1-ib"),
     ("rack[2-3]-n[07,09]", "rack2-n07"), ("n[1-3],m[4]", "n1")],
)  # fmt: skip
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert _env.first_host(nodelist) == first


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "8", "WORLD_SIZE": "8"}, "global rank must be below"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank must be"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "cannot hold more"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "must be >= 0"),
        ({"RANK": "3"}, "global rank must be below"),  # a rank without a world size
    ],
)
def test_contradictory_environment_raises_before_anything(monkeypatch, env, match) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: pytest.fail("initialised"))
    with pytest.raises(SpeedupsError, match=match):
        init_distributed()
    model = nn.Linear(2, 2)
    with pytest.raises(SpeedupsError, match=match):
        ddp_wrap(model.to("meta"))
    with pytest.raises(SpeedupsError, match=match):
        distributed(DataLoader(range(4)))


# ------------------------------------------------------------------------------------------------ ddp_wrap
def test_ddp_wrap_single_process_returns_the_model_on_its_device() -> None:
    model = nn.Linear(3, 1)
    assert ddp_wrap(model) is model and model.weight.device == default_device()
    assert ddp_wrap(nn.Linear(3, 1), strategy="fsdp").__class__ is nn.Linear
    assert not torch.distributed.is_initialized()


def test_ddp_wrap_bad_input_leaves_the_model_untouched(monkeypatch) -> None:
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        ddp_wrap(frozen)
    with pytest.raises(ValueError, match="strategy='zero'"):
        ddp_wrap(nn.Linear(2, 2), strategy="zero")
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module"):
        ddp_wrap("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bucket_size_mb"):
        ddp_wrap(nn.Linear(2, 2), bucket_size_mb=4)
    # LOCAL_RANK beyond the GPUs present: clear error, the model stays where it was.
    _a8(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = nn.Linear(2, 2)
    with pytest.raises(SpeedupsError, match="LOCAL_RANK=3 but this machine has 2 CUDA"):
        ddp_wrap(model)
    assert model.weight.device.type == "cpu"


def test_ddp_wrap_fsdp_missing_is_a_clear_error(monkeypatch) -> None:
    mod = sys.modules["speedups.distributed"]  # the attribute speedups.distributed is the function

    monkeypatch.setattr(mod, "_fully_shard", lambda: None)
    with pytest.raises(SpeedupsError, match=r"no torch\.distributed\.fsdp\.fully_shard"):
        ddp_wrap(nn.Linear(2, 2), strategy="fsdp")


# ------------------------------------------------------------------------------------ rank zero and seeds
class _Logger:
    def __init__(self) -> None:
        self.lines: list[str] = []

    @rank_zero_only
    def log(self, line: str) -> str:
        self.lines.append(line)
        return line


def test_rank_zero_only_and_print_run_on_global_rank_zero_only(monkeypatch, capsys) -> None:
    logger = _Logger()
    assert logger.log("a") == "a"
    rank_zero_print("shown")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert logger.log("b") is None
    rank_zero_print("hidden")
    assert logger.lines == ["a"] and capsys.readouterr().out == "shown\n"
    assert _Logger.log.__name__ == "log"


def test_seed_everything_seeds_torch_numpy_and_random() -> None:
    state = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        seed_everything(7)
        first = (torch.rand(3), np.random.rand(3), random.random())
        seed_everything(7)
        second = (torch.rand(3), np.random.rand(3), random.random())
        assert torch.equal(first[0], second[0]) and (first[1] == second[1]).all() and first[2] == second[2]
        with pytest.raises(TypeError, match=r"seed=1\.5"):
            seed_everything(1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="2\\*\\*32"):
            seed_everything(-1)
    finally:
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])


def test_init_distributed_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout=0"):
        init_distributed(timeout=0)
    assert init_distributed() is False


@pytest.mark.parametrize("bad", [{"batches": -2}, {"batches": 1.7}, {"epoch": -3}, {"batches": 10**6}])
def test_loader_load_state_dict_rejects_impossible_positions(bad) -> None:
    loader = distributed(DataLoader(list(range(10)), batch_size=3, shuffle=True), rank=0, world_size=2)
    good = loader.state_dict()
    with pytest.raises(ValueError, match=r"DistributedLoader.load_state_dict\(state\)"):
        loader.load_state_dict({**good, **bad})
    assert loader.state_dict() == good and len(list(loader)) == 2  # 5 samples on this rank: 2 batches

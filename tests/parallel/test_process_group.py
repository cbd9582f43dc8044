"""Tip 9's process half in one process: the environment mapping, init_distributed, ddp_wrap, rank zero, seeds.

Multi-process runs (real torchrun jobs) are in tests/test_distributed_jobs.py.
"""

from __future__ import annotations

import os
import random
import stat
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import speedups.parallel.data_parallel
import speedups.parallel.rendezvous
from speedups import (
    SpeedupsError,
    ddp_wrap,
    default_device,
    distributed,
    init_distributed,
    is_main_process,
    rank_zero_only,
    rank_zero_print,
    seed_everything,
)
from speedups._helpers import env as _env
from tests._dist import HAS_FSDP2


# ---------------------------------------------------------------------------------------- A8: environment
def _a8(monkeypatch) -> None:
    for key, value in {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


class _Store:
    def set_timeout(self, value: timedelta) -> None:
        self.timeout = value


def _fake_rendezvous(monkeypatch, calls: dict) -> None:
    """Record what init_distributed hands to the rendezvous and to init_process_group; start nothing."""
    store = _Store()
    monkeypatch.setattr(
        speedups.parallel.rendezvous,
        "join",
        lambda url, **kw: calls.setdefault("join", {"url": url, **kw}) and store,
    )
    monkeypatch.setattr(torch.distributed, "PrefixStore", lambda prefix, inner: (prefix, inner))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.setdefault("init", kw))


def test_device_from_local_rank_process_group_and_sampler_from_global_rank(monkeypatch) -> None:
    _a8(monkeypatch)
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    _fake_rendezvous(monkeypatch, calls)
    assert default_device() == torch.device("cuda", 1)
    assert init_distributed(timeout=60, rendezvous_timeout=20) is True
    init, join = calls["init"], calls["join"]
    assert init["rank"] == 5 and init["world_size"] == 8 and init["backend"] == "nccl"  # type: ignore[index]
    assert init["timeout"] == timedelta(seconds=60)  # type: ignore[index]
    prefix, store = init["store"]  # type: ignore[index]
    assert prefix == "speedups/attempt_0" and store.timeout == timedelta(seconds=60)  # collectives: long
    assert join["url"] == "env://" and join["timeout_s"] == 20  # type: ignore[index]  # joining: short
    assert (join["rank"], join["world_size"]) == (5, 8)  # type: ignore[index]
    assert calls["set_device"] == torch.device("cuda", 1)
    sampler = distributed(DataLoader(list(range(16)), batch_size=2, shuffle=True)).distributed_sampler
    assert (sampler.rank, sampler.num_replicas) == (5, 8)
    assert not is_main_process()  # logging and checkpoints: global rank 0 only
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")  # local rank 0 of the second node is not the main process
    assert not is_main_process()


def test_slurm_only_uses_tcp_init_with_the_first_node(monkeypatch) -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)",
             "SLURM_STEP_ID": "0"}  # fmt: skip
    for key, value in {**slurm, "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: parse the list
    calls: dict[str, dict] = {}
    _fake_rendezvous(monkeypatch, calls)
    assert init_distributed() is True
    assert calls["join"]["url"] == "tcp://gpu07:29500" and calls["init"]["backend"] == "gloo"
    assert (calls["join"]["rank"], calls["join"]["world_size"]) == (3, 4)
    assert (calls["init"]["rank"], calls["init"]["world_size"]) == (3, 4)
    assert calls["join"]["shown"]["MASTER_ADDR"] == "(unset, used gpu07)"
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
        ({"RANK": "3"}, "WORLD_SIZE not set, though a launcher sets them all"),  # a rank without a world size
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


# ------------------------------------------------------------------------- the GPU of a user's process group
class _Placed(nn.Linear):
    """A model that records where it is moved (no GPU here: CUDA is stood in)."""

    def to(self, *args, **kwargs):  # type: ignore[override]
        self.moved_to = args[0] if args else kwargs.get("device")
        return self


def test_ddp_wrap_makes_the_local_rank_gpu_current_with_a_process_group_the_user_made(monkeypatch) -> None:
    """A8 (LOCAL_RANK=1 of 4 GPUs), dist.init_process_group called by the script without set_device: the
    current device stayed cuda:0 on every rank; after ddp_wrap it is cuda:1, where the model went."""
    _a8(monkeypatch)
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", torch.device(d)))
    monkeypatch.setattr(speedups.parallel.data_parallel, "start_process_group", lambda **kw: True)  # running
    monkeypatch.setattr(
        nn.parallel, "DistributedDataParallel", lambda m, **kw: calls.setdefault("ddp", kw) and m
    )
    model = _Placed(3, 1)
    ddp_wrap(model)
    assert model.moved_to == torch.device("cuda", 1)
    assert calls["set_device"] == torch.device("cuda", 1)  # the collectives' device: the model's GPU
    assert calls["ddp"] == {"device_ids": [1]}


def test_collectives_run_on_this_ranks_gpu_under_nccl_whatever_is_current(monkeypatch) -> None:
    """A8 under NCCL with cuda:0 current: speedups' collectives use cuda:1 (LOCAL_RANK), and the object
    collectives run with it current; under gloo, the CPU, and nothing is switched."""
    _a8(monkeypatch)
    entered: list[object] = []

    class _Device:  # torch.cuda.device, recorded
        def __init__(self, device: object) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)

        def __exit__(self, *exc: object) -> None:
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(_env, "pg_ready", lambda: True)
    for backend, want in [("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))]:
        monkeypatch.setattr(torch.distributed, "get_backend", lambda *a, backend=backend: backend)
        assert _env.comm_device() == want
        entered.clear()
        with _env.on_comm_device() as place:
            assert place == want
        assert entered == ([want, "exit"] if want.type == "cuda" else [])


def test_no_collective_of_speedups_uses_the_current_cuda_device() -> None:
    """The whole kind: NCCL collectives read their device from env.comm_device(), and every object
    collective or barrier runs inside env.on_comm_device(): none trusts torch.cuda.current_device()."""
    import ast

    root = Path(speedups.parallel.data_parallel.__file__).resolve().parents[1]
    helpers = {"env.py", "hardware.py", "device.py", "measure.py"}  # device rules; the profiler's fallback
    found = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any("on_comm_device" in ast.unparse(i) for i in node.items):
                for inner in ast.walk(node):
                    inner.inside = True  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if (
                name.endswith("current_device")
                and path.name not in helpers
                and "environments" not in path.parts
            ):
                found.append(f"{path.name}:{node.lineno} {name}")
            collective = name.split(".")[-1] in {"all_gather_object", "broadcast_object_list", "barrier"}
            torch_dist = "distributed" in name or name.startswith("dist.")
            if collective and torch_dist and not getattr(node, "inside", False):
                found.append(f"{path.name}:{node.lineno} {name} outside on_comm_device")
    assert found == []


# ------------------------------------------------------------------------------------------------ ddp_wrap
def test_ddp_wrap_single_process_returns_the_model_on_its_device() -> None:
    model = nn.Linear(3, 1)
    assert ddp_wrap(model) is model and model.weight.device == default_device()
    if HAS_FSDP2:  # public from torch 2.6
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
    monkeypatch.setattr(speedups.parallel.data_parallel, "_fully_shard", lambda: None)
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


# ------------------------------------------------------------------------------------ rendezvous, rank zero
@pytest.mark.slow
def test_a_rendezvous_that_cannot_complete_fails_fast_naming_the_variables(monkeypatch, capfd) -> None:
    """n06: a stale WORLD_SIZE=2 with no peer: a notice on stderr, then an error within the short timeout."""
    from tests._dist import free_port

    port = free_port()
    for key, value in {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(speedups.parallel.rendezvous, "NOTICE_AFTER_S", 0.5)
    with pytest.raises(SpeedupsError) as info:
        init_distributed(rendezvous_timeout=2)
    message = str(info.value)
    for name in (
        "MASTER_ADDR=127.0.0.1",
        f"MASTER_PORT={port}",
        "WORLD_SIZE=2",
        "RANK=0",
        "1 of 2 processes joined",
    ):
        assert name in message, message
    assert "rank 0 is waiting for the other processes" in capfd.readouterr().err
    assert not torch.distributed.is_initialized()


def test_rank_zero_only_refuses_a_class() -> None:
    class Logger:
        pass

    with pytest.raises(TypeError, match=r"rank_zero_only\(.*Logger\): a class cannot be rank-zero-only"):
        rank_zero_only(Logger)
    with pytest.raises(TypeError, match="expected a function"):
        rank_zero_only(3)  # type: ignore[arg-type]


def test_init_distributed_bad_rendezvous_timeout() -> None:
    with pytest.raises(ValueError, match="rendezvous_timeout=0"):
        init_distributed(rendezvous_timeout=0)


def test_ddp_wrap_of_a_model_on_the_meta_device_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"ddp_wrap\(model=Linear, device='cpu'\): the model is on the meta.*to_empty"
    ):
        ddp_wrap(torch.nn.Linear(2, 2, device="meta"), device="cpu")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_process_gloo_script_exits_0_every_time_with_or_without_destroy_distributed() -> None:
    """gloo's threads freeing the last collective's work while Python finalises aborted the exit (plain
    PyTorch too, destroy_process_group() or not); speedups ends the group it started at exit."""
    from tests._dist import ROOT, run_torchrun

    script = ROOT / "tests" / "workers" / "exit_without_destroy.py"
    failed = []
    for run in range(20):
        destroy = "1" if run % 4 == 3 else "0"  # 15 runs that leave the group open, 5 that end it
        out = run_torchrun(script, env={"DESTROY": destroy}, timeout=120)
        if out.returncode != 0:
            failed.append(f"run {run} (DESTROY={destroy}): {out.returncode}: {out.stderr[-300:]}")
    assert not failed, "\n".join(failed)

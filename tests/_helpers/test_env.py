"""The one rule for rank, world size and device under every launch style, with faked CUDA device counts."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from speedups import SpeedupsError, SpeedupsWarning, ddp_wrap, default_device, distributed, init_distributed
from speedups._helpers import env as _env
from speedups._helpers.environments import LaunchEnvironment, registry

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
# What `srun --ntasks-per-node=2 ...` gives task 1 (SLURM_STEP_ID: only srun sets it).
SRUN = {
    "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
}  # fmt: skip
# A shell in `salloc --ntasks=4` (or an sbatch script) running plain `python`: no SLURM_PROCID/STEP_ID.
SALLOC = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1"}
# An sbatch batch script: SLURM_PROCID=0 of the batch step, but no srun step.
SBATCH = {**SALLOC, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(
    ("env", "style", "values"),
    [
        ({}, "single", (0, 0, 1, 1)),
        (TORCHRUN, "torchrun", (1, 1, 2, 2)),
        (SRUN, "srun", (3, 1, 4, 2)),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": ""}, "srun", (3, 1, 2, 1)),
        ({**SRUN, "SLURM_NTASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": "2(x2)"}, "srun", (3, 1, 4, 2)),
        ({**SRUN, **TORCHRUN}, "torchrun", (1, 1, 2, 2)),  # `srun torchrun ...`: torchrun's view wins
        (SALLOC, "allocation", (0, 0, 1, 1)),
        (SBATCH, "allocation", (0, 0, 1, 1)),
        ({"WORLD_SIZE": "2"}, "torchrun", (0, 0, 2, 1)),  # a stale WORLD_SIZE still reads as a job
    ],
)
def test_launch_style_and_placement_from_slurm_and_torchrun_shapes(env, style, values) -> None:
    assert _env.launch_style(env) == style
    assert (_env.rank(env), _env.local_rank(env), _env.world_size(env), _env.local_world_size(env)) == values


@pytest.mark.parametrize(
    ("env", "count", "index"),
    [
        ({}, 4, 0),  # plain process: cuda:0 (CUDA not initialised, so no set_device happened)
        (TORCHRUN, 2, 1),  # torchrun and launch(): cuda:LOCAL_RANK
        (
            {**TORCHRUN, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
            4,
            1,
        ),  # never the global rank
        (SRUN, 1, 0),  # srun --gpus-per-task=1: the task's only GPU is cuda:0 (c23)
        (SRUN, 2, 1),  # srun with all of the node's GPUs visible: cuda:SLURM_LOCALID
        ({**SRUN, "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}, 2, 1),  # --gpus-per-task=2: 2 visible
        (SALLOC, 4, 0),  # no srun: one process
    ],
)
def test_device_rule_with_faked_device_counts(env, count, index) -> None:
    assert _env.cuda_index(env, count=count) == index


def test_torchrun_local_rank_beyond_the_visible_gpus_is_an_error() -> None:
    with pytest.raises(SpeedupsError, match=r"LOCAL_RANK=1 but this machine has 1 CUDA device"):
        _env.cuda_index(TORCHRUN, count=1)


def _fake_cuda(monkeypatch, count: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def _only(monkeypatch, env: dict[str, str]) -> None:
    for key in list(os.environ):
        if key.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD", "MASTER_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_default_device_srun_one_gpu_per_task_and_cuda_visible_devices_subset(monkeypatch) -> None:
    _fake_cuda(monkeypatch, 1)
    _only(monkeypatch, {**SRUN, "CUDA_VISIBLE_DEVICES": "1"})
    assert default_device() == torch.device("cuda", 0)
    _fake_cuda(monkeypatch, 2)  # CUDA_VISIBLE_DEVICES=2,3 on a 4-GPU node: indices are within the subset
    _only(monkeypatch, {**SRUN, "CUDA_VISIBLE_DEVICES": "2,3"})
    assert default_device() == torch.device("cuda", 1)


def test_default_device_in_mp_spawn_is_the_current_device_after_set_device(monkeypatch) -> None:
    """mp.spawn: no launcher variables, the user's own process group, torch.cuda.set_device(rank)."""
    _only(monkeypatch, {})
    _fake_cuda(monkeypatch, 2, current=1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # the user's own process group
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    assert _env.launch_style() == "process"
    assert default_device() == torch.device("cuda", 1)
    assert (_env.rank(), _env.world_size()) == (1, 2)


def test_explicit_ddp_wrap_device_overrides_every_rule(monkeypatch) -> None:
    _fake_cuda(monkeypatch, 2)
    _only(monkeypatch, {"RANK": "0", "LOCAL_RANK": "3", "WORLD_SIZE": "1"})  # the rule would raise here
    with pytest.raises(SpeedupsError, match="LOCAL_RANK=3"):
        default_device()
    model = ddp_wrap(nn.Linear(2, 1), device="cpu")
    assert model.weight.device == torch.device("cpu")
    model = ddp_wrap(nn.Linear(2, 1), device="meta")
    assert model.weight.device == torch.device("meta")


def test_slurm_allocation_without_srun_runs_as_one_process_with_one_warning(monkeypatch) -> None:
    """c24: `python train.py` in `salloc -n 4`: all 16 samples, no wait for 3 peers, one warning."""
    _only(monkeypatch, SALLOC)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: pytest.fail("initialised"))
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: once per location
        seen = sorted(int(v) for (b,) in distributed(loader) for v in b)
        assert init_distributed() is False
        assert ddp_wrap(nn.Linear(2, 1)).__class__ is nn.Linear
    assert seen == list(range(16))
    mine = [w for w in caught if issubclass(w.category, SpeedupsWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "srun python" in str(mine[0].message) and "SLURM_NTASKS=4" in str(mine[0].message)
    with pytest.warns(SpeedupsWarning, match="not started by srun"):
        _env.placement()


class _LSF(LaunchEnvironment):
    """A launch style the package does not know, written as a new one would be: IBM LSF's jsrun variables."""

    name = "lsf"
    launched = True

    @classmethod
    def detect(cls, env, *, live: bool) -> bool:
        return bool(env.get("JSM_NAMESPACE_RANK"))

    def rank(self) -> int:
        return int(self.env["JSM_NAMESPACE_RANK"])

    def local_rank(self) -> int:
        return int(self.env["JSM_NAMESPACE_LOCAL_RANK"])

    def world_size(self) -> int:
        return int(self.env["JSM_NAMESPACE_SIZE"])

    def cuda_index(self, count: int) -> int:
        return self.local_rank() % count


def test_a_new_launch_environment_is_one_class_and_one_entry_in_the_list(monkeypatch) -> None:
    lsf = {"JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_LOCAL_RANK": "1", "JSM_NAMESPACE_SIZE": "8"}
    assert _env.launch_style(lsf) == "single"  # unknown until registered
    monkeypatch.setattr(registry, "ENVIRONMENTS", (_LSF, *registry.ENVIRONMENTS))
    assert _env.launch_style(lsf) == "lsf"
    here = _env.placement(lsf, call="test")
    assert (here.rank, here.local_rank, here.world_size, here.local_world_size) == (5, 1, 8, 1)
    assert _env.cuda_index(lsf, count=4) == 1 and _env.is_distributed(lsf)
    assert _env.launch_style(TORCHRUN) == "torchrun"  # the others are unchanged


def test_every_launch_environment_is_registered_and_single_process_comes_last() -> None:
    classes = {cls for cls in _subclasses(LaunchEnvironment) if cls.__module__.startswith("speedups.")}
    assert classes == set(registry.ENVIRONMENTS)
    assert registry.ENVIRONMENTS[-1].name == "single" and registry.ENVIRONMENTS[0].name == "torchrun"
    assert len({cls.name for cls in registry.ENVIRONMENTS}) == len(registry.ENVIRONMENTS)


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


@pytest.mark.parametrize("read", [_env.rank, _env.local_rank, _env.world_size, _env.local_world_size])
def test_a_malformed_launcher_variable_is_an_error_whichever_value_is_read(read) -> None:
    bad = {"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        read(bad)
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        _env.cuda_index(bad, count=1)


@pytest.mark.parametrize(
    ("leftover", "missing"), [({"WORLD_SIZE": "2"}, "RANK"), ({"RANK": "1"}, "WORLD_SIZE")]
)
def test_a_launcher_variable_left_alone_in_the_shell_is_named(monkeypatch, leftover, missing) -> None:
    from speedups import rank_zero_print, world_size

    _only(monkeypatch, leftover)
    for call in (world_size, lambda: rank_zero_print("x"), lambda: distributed(DataLoader(list(range(10))))):
        with pytest.raises(SpeedupsError, match=rf"{missing} not set, though a launcher sets them all"):
            call()

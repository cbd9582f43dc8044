"""SLURM's ``srun``: a job step whose tasks are the processes (``SLURM_PROCID``, ``SLURM_STEP_ID``)."""

from __future__ import annotations

from collections.abc import Mapping

from speedups._helpers.environments.base import LaunchEnvironment, read_int

__all__ = ["SlurmStep"]

_LOCAL_WORLD = ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


class SlurmStep(LaunchEnvironment):
    """Started by ``srun`` (only srun sets ``SLURM_STEP_ID``). The device is
    ``cuda:(SLURM_LOCALID % visible GPUs)``: with one GPU bound per task (``--gpus-per-task=1``) every
    task's GPU is ``cuda:0``; with all of a node's GPUs visible it is ``cuda:SLURM_LOCALID``."""

    name = "srun"
    launched = True

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        return bool(env.get("SLURM_PROCID") and env.get("SLURM_STEP_ID"))

    def rank(self) -> int:
        return read_int(self.env, ("SLURM_PROCID",), 0)

    def local_rank(self) -> int:
        return read_int(self.env, ("SLURM_LOCALID",), 0)

    def world_size(self) -> int:
        return read_int(self.env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), 1)

    def local_world_size(self) -> int:
        return read_int(self.env, _LOCAL_WORLD, 1)

    def states_local_world_size(self) -> bool:
        return any(self.env.get(name) for name in _LOCAL_WORLD)

    def cuda_index(self, count: int) -> int:
        return self.local_rank() % max(count, 1)

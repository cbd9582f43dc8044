"""A SLURM allocation of several tasks whose script runs without ``srun`` (``python train.py`` in salloc)."""

from __future__ import annotations

from collections.abc import Mapping

from speedups._helpers.environments.base import LaunchEnvironment, read_int

__all__ = ["SlurmAllocation"]


def _tasks(env: Mapping[str, str]) -> int:
    return read_int(env, ("SLURM_NTASKS", "SLURM_NPROCS"), 0)


class SlurmAllocation(LaunchEnvironment):
    """SLURM variables of more than one task, but no srun step: one process on all the data, with one
    warning that says how to start the tasks (waiting for peers that never start would hang)."""

    name = "allocation"

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        return _tasks(env) > 1

    def notice(self) -> str:
        tasks = _tasks(self.env)
        return (
            f"speedups: SLURM allocated {tasks} tasks (SLURM_NTASKS={tasks}) but this process was not started"
            f" by srun (no SLURM_PROCID/SLURM_STEP_ID), so it runs alone as 1 process on all the data. To "
            f"use the {tasks} tasks, start them with `srun python script.py`, or use "
            f"`torchrun --nproc-per-node {tasks} script.py` or speedups.launch(fn, nprocs={tasks})."
        )

"""The launch styles, in the order they are tried: the first whose ``detect`` is true describes the process.

A new style (LSF, MPI) is a :class:`~.base.LaunchEnvironment` subclass in a new file of this folder and
one entry in :data:`ENVIRONMENTS`, before :class:`~.single.SingleProcess`, which always matches.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from speedups._helpers.environments.base import LaunchEnvironment
from speedups._helpers.environments.single import SingleProcess
from speedups._helpers.environments.slurm_allocation import SlurmAllocation
from speedups._helpers.environments.slurm_step import SlurmStep
from speedups._helpers.environments.spawned import SpawnedProcess
from speedups._helpers.environments.torchrun import TorchElastic

__all__ = ["ENVIRONMENTS", "detect"]

ENVIRONMENTS: tuple[type[LaunchEnvironment], ...] = (
    TorchElastic,  # first: `srun torchrun ...` is torchrun's view of the job
    SlurmStep,
    SpawnedProcess,
    SlurmAllocation,
    SingleProcess,
)


def detect(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """The launch environment of this process (``env`` given: only that mapping is read, no process group)."""
    env_map = os.environ if env is None else env
    for kind in ENVIRONMENTS:
        if kind.detect(env_map, live=env is None):
            return kind(env_map)
    return SingleProcess(env_map)

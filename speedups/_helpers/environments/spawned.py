"""A process that made its own process group (``mp.spawn`` and ``torch.cuda.set_device(rank)``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from speedups._helpers.environments.base import LaunchEnvironment, pg_ready

__all__ = ["SpawnedProcess"]


class SpawnedProcess(LaunchEnvironment):
    """No launcher variables, but an initialised process group: it gives rank and world size, and the
    device is the current CUDA device (what ``torch.cuda.set_device(...)`` chose)."""

    name = "process"
    launched = True

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        return live and pg_ready()

    def rank(self) -> int:
        return int(torch.distributed.get_rank())

    def world_size(self) -> int:
        return int(torch.distributed.get_world_size())

    def cuda_index(self, count: int) -> int:
        return int(torch.cuda.current_device())

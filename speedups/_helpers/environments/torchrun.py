"""torchrun, ``torch.distributed.elastic`` and :func:`~speedups.launch`: ``RANK``, ``LOCAL_RANK``, ..."""

from __future__ import annotations

from collections.abc import Mapping

from speedups._helpers.environments.base import LaunchEnvironment, read_int
from speedups.errors import SpeedupsError

__all__ = ["TorchElastic"]

_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class TorchElastic(LaunchEnvironment):
    """Started by torchrun (or anything that sets its variables): they give rank and world size, and the
    device is ``cuda:LOCAL_RANK``, never the global rank (a second node uses its own GPUs 0..k-1)."""

    name = "torchrun"
    launched = True

    @classmethod
    def detect(cls, env: Mapping[str, str], *, live: bool) -> bool:
        return any(env.get(name) for name in _VARIABLES)

    def rank(self) -> int:
        return read_int(self.env, ("RANK",), 0)

    def local_rank(self) -> int:
        return read_int(self.env, ("LOCAL_RANK",), 0)

    def world_size(self) -> int:
        return read_int(self.env, ("WORLD_SIZE",), 1)

    def local_world_size(self) -> int:
        return read_int(self.env, ("LOCAL_WORLD_SIZE",), 1)

    def missing(self) -> list[str]:
        return [name for name in ("RANK", "WORLD_SIZE") if not self.env.get(name)]

    def states_local_world_size(self) -> bool:
        return bool(self.env.get("LOCAL_WORLD_SIZE"))

    def cuda_index(self, count: int) -> int:
        index = self.local_rank()
        if not 0 <= index < count:
            raise SpeedupsError(
                f"default_device(): LOCAL_RANK={index} but this machine has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}). Start at most {count} processes per node, e.g. "
                f"`torchrun --nproc-per-node {count} ...`, or pass ddp_wrap(model, device=...)."
            )
        return index

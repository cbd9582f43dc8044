"""The RNG states of every rank in a checkpoint: gathered when saving, this rank's restored when loading."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from speedups._helpers import env
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups.checkpoint import file_format
from speedups.checkpoint.entries import collective
from speedups.errors import SpeedupsWarning

__all__ = ["gather_rng", "restore_rng", "rng_of_this_rank"]


def gather_rng() -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (an ``all_gather_object`` when there are several ranks)."""
    mine = file_format.rng_to_file(get_rng_states())
    if not collective():
        return [mine]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    with env.on_comm_device():  # this rank's GPU under NCCL, not whatever is current
        torch.distributed.all_gather_object(every, mine)  # collective: checkpoints are saved by every rank
    return every


def restore_rng(every: list[dict[str, Any]]) -> None:
    """Restore this rank's states from ``every`` rank's, when the world size is the same."""
    rng = rng_of_this_rank(every, "load_checkpoint", None)
    if rng is not None:
        set_rng_states(rng)


def rng_of_this_rank(
    every: list[dict[str, Any]] | None, said: str, ranks: list[int] | None
) -> dict[str, Any] | None:
    """This rank's saved RNG states, checked; None (and a warning) when saved with another world size.

    ``ranks``: the ranks whose states ``every`` holds (a checkpoint saved by rank 0 alone holds rank 0's
    only: the other ranks keep their current states, and rank 0 says so once); None: every rank's, in order.
    """
    if every is None:
        return None
    world, rank = env.world_size(), env.rank()
    if ranks is not None:
        if rank == 0 and world > 1:
            warnings.warn(
                f"load_checkpoint: the checkpoint was saved by rank 0 alone and holds the RNG states of "
                f"ranks {ranks} only; the other ranks keep their current ones (all else was restored).",
                SpeedupsWarning,
                stacklevel=3,
            )
        return file_format.checked_rng(every[ranks.index(rank)], said) if rank in ranks else None
    if len(every) == world:
        return file_format.checked_rng(every[rank], said)
    if rank == 0:
        warnings.warn(
            f"load_checkpoint: saved with world size {len(every)}, loaded with {world}; RNG states were not "
            f"restored (everything else was).",
            SpeedupsWarning,
            stacklevel=3,
        )
    return None

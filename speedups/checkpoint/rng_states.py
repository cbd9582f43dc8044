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
    torch.distributed.all_gather_object(every, mine)  # collective: checkpoints are saved by every rank
    return every


def restore_rng(every: list[dict[str, Any]]) -> None:
    """Restore this rank's states from ``every`` rank's, when the world size is the same."""
    rng = rng_of_this_rank(every, "load_checkpoint")
    if rng is not None:
        set_rng_states(rng)


def rng_of_this_rank(every: list[dict[str, Any]] | None, said: str) -> dict[str, Any] | None:
    """This rank's saved RNG states, checked; None (and a warning) when saved with another world size."""
    if every is None:
        return None
    world, rank = env.world_size(), env.rank()
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

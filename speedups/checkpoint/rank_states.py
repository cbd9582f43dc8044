"""What differs per rank in a checkpoint: every rank's RNG states and the states of its per-rank objects.

Under data parallelism a model, its optimizer and an LR scheduler are the same on every rank; everything
else may not be: an ``@accumulate`` step in the middle of a window holds this rank's own unreduced
gradients, a ``LossTracker`` its own sums, a loader the state its workers' seed was drawn from, and every
rank has its own RNG streams (dropout draws differ per rank). ``save_checkpoint`` gathers those to rank 0,
which writes them beside rank 0's own; ``load_checkpoint`` hands each rank its own back. Resumed on another
number of processes, :mod:`speedups.checkpoint.layout_change` merges them instead.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from speedups._helpers import env
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups.checkpoint import file_format
from speedups.checkpoint.entries import collective
from speedups.errors import SpeedupsWarning

__all__ = ["gather_rank_states", "is_per_rank", "restore_rng", "rng_of_this_rank", "state_of_this_rank"]

_SHARED = (nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)


def is_per_rank(obj: Any) -> bool:
    """Whether ``obj``'s state may differ between ranks: anything but a model, an optimizer or an LR
    scheduler (which data parallelism keeps equal on every rank)."""
    return not isinstance(obj, _SHARED)


def gather_rank_states(
    states: dict[str, Any], *, to_all: bool = False
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]] | None:
    """Gather every rank's RNG states and ``states`` (per-rank objects' states, by name).

    One ``gather_object`` to rank 0 (``all_gather_object`` with ``to_all``: every rank gets the same, as a
    sharded checkpoint needs). Collective: every rank calls it at the same point.

    Returns:
        On rank 0: the RNG states in rank order, and per name the states in rank order with ``None`` at index
        0 (rank 0's is the entry itself, which rank 0 writes); None on the other ranks. With ``to_all``, on
        every rank, the same with rank 0's states at index 0 too: rank 0's come from the gather, never from
        the calling rank. In one process: ``([this process's RNG states], {})`` (with ``to_all``, per name
        ``[states[name]]``).
    """
    mine = {"rng": file_format.rng_to_file(get_rng_states()), "states": states}
    if not collective():
        return [mine["rng"]], ({name: [state] for name, state in states.items()} if to_all else {})
    world = torch.distributed.get_world_size()
    every: list[Any] | None = [None] * world if to_all or env.rank() == 0 else None
    with env.on_comm_device():  # this rank's GPU under NCCL, not whatever is current
        if every is not None and to_all:
            torch.distributed.all_gather_object(every, mine)
        else:
            torch.distributed.gather_object(mine, every, dst=0)
    if every is None:
        return None
    first = 0 if to_all else 1  # without to_all rank 0 writes its own states as the entries themselves
    per_rank = {
        name: [None] * first + [every[r]["states"][name] for r in range(first, world)] for name in states
    }
    return [r["rng"] for r in every], per_rank


def state_of_this_rank(entry: str, rank0_state: Any, per_rank: dict[str, list[Any]] | None) -> Any:
    """The state this rank saved under ``entry``: its own where the file holds per-rank states, else rank
    0's (a model, an optimizer, a file written by one process or by an older speedups)."""
    rank = env.rank()
    own = (per_rank or {}).get(entry)
    if rank == 0 or own is None or rank >= len(own):
        return rank0_state
    return own[rank]


def restore_rng(every: list[dict[str, Any]]) -> None:
    """Restore this rank's states from ``every`` rank's, when the world size is the same."""
    rng = rng_of_this_rank(every, "load_checkpoint", None, 5)
    if rng is not None:
        set_rng_states(rng)


def rng_of_this_rank(
    every: list[dict[str, Any]] | None, said: str, ranks: list[int] | None, stacklevel: int = 3
) -> dict[str, Any] | None:
    """This rank's saved RNG states, checked; None (and a warning) when saved with another world size.

    ``ranks``: the ranks whose states ``every`` holds (a checkpoint saved by rank 0 alone holds rank 0's
    only: the other ranks keep their current states, and rank 0 says so once); None: every rank's, in order.
    ``stacklevel``: the warnings' (the frames up to the user's call, this one included).
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
                stacklevel=stacklevel,
            )
        return file_format.checked_rng(every[ranks.index(rank)], said) if rank in ranks else None
    if len(every) == world:
        return file_format.checked_rng(every[rank], said)
    if rank == 0:
        warnings.warn(
            f"load_checkpoint: saved with {len(every)} process{'es' if len(every) > 1 else ''}, resumed on "
            f"{world}; each rank keeps its "
            f"current RNG states, so randomness drawn in the training processes (dropout) follows the new "
            f"layout; everything else was restored.",
            SpeedupsWarning,
            stacklevel=stacklevel,
        )
    return None

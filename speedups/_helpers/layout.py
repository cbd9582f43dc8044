"""What a resume on another layout (processes, micro-steps per window, batch size) tells each object.

:mod:`speedups.checkpoint.layout_change` checks that a checkpoint can continue exactly on this run's layout
and computes where it continues; each object with per-rank state then merges the states its ranks saved
into this rank's state through its ``_merge_rank_states(states, change)`` (the ``@accumulate`` step, a
``DistributedLoader``, a ``LossTracker``).
"""

from __future__ import annotations

import dataclasses

__all__ = ["LayoutChange"]


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """Where a checkpoint saved on ``saved_world`` processes continues on this rank of ``world``.

    Attributes:
        saved_world: processes that saved the checkpoint.
        world: processes now; ``rank``: this one's rank.
        batches: batches of the current epoch already handed out on each rank, in this run's batch size
            (None: no loader to place).
        pending: micro-steps of the open window, in this run's micro-steps (None: no step to place).
        micro_steps: micro-steps so far, in this run's micro-steps (counted as if each were full-size).
    """

    saved_world: int
    world: int
    rank: int
    batches: int | None = None
    pending: int | None = None
    micro_steps: int | None = None

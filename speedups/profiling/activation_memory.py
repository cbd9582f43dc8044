"""What one measured step kept for backward, per block: the numbers the activation-memory advice reads.

``profile_steps(model=...)`` fills it from :class:`speedups.memory.saved_activations.SavedActivations`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivationMemory", "BlockMemory"]


@dataclass(frozen=True)
class BlockMemory:
    """One block's share of the activations kept for backward on the measured step.

    ``kept`` bytes were saved while its forward ran; ``inputs`` bytes were handed to it (what a checkpoint of
    it keeps); ``seconds`` of host time in its forward (what its recompute would cost, about).
    """

    name: str
    kept: int
    inputs: int
    seconds: float
    checkpointed: bool = False

    @property
    def saving(self) -> int:
        """Bytes that checkpointing this block would free: what it keeps less its inputs (0 if done)."""
        return 0 if self.checkpointed else max(self.kept - self.inputs, 0)


@dataclass(frozen=True)
class ActivationMemory:
    """The activations kept for backward on one measured step (``profile_steps(model=...)``), in bytes."""

    peak: int
    total: int
    parameters: int
    blocks: tuple[BlockMemory, ...]

    def best_blocks(self) -> list[BlockMemory]:
        """The blocks worth checkpointing (each frees >= 2% of the total), most bytes per second first."""
        worth = [b for b in self.blocks if b.saving >= 0.02 * self.total and b.saving > 0]
        return sorted(worth, key=lambda b: b.saving / max(b.seconds, 1e-9), reverse=True)

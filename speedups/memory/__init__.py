"""Tips 3 and 4's memory levers: the batch size that fits, and activation checkpointing by name."""

from speedups.memory.activation_checkpointing import (
    checkpoint_activations,
    checkpointed,
    checkpointed_modules,
    uncheckpoint_activations,
)
from speedups.memory.batch_search import AccumulationPlan, accumulation_plan, find_batch_size
from speedups.memory.blocks import model_blocks

__all__ = [
    "AccumulationPlan",
    "accumulation_plan",
    "checkpoint_activations",
    "checkpointed",
    "checkpointed_modules",
    "find_batch_size",
    "model_blocks",
    "uncheckpoint_activations",
]

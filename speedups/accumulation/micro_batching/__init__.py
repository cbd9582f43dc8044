"""Micro-batching, a strategy of ``@accumulate``: one call's batch run as micro-batches that fit."""

from speedups.accumulation.micro_batching.batcher import (
    AUTO,
    MicroBatcher,
    MicroBatchHost,
    check_micro_batching,
)
from speedups.accumulation.micro_batching.memory_plan import MemoryPlan, PlanChoice, check_memory_budget
from speedups.accumulation.micro_batching.splitting import custom_split, split_call

__all__ = [
    "AUTO",
    "MemoryPlan",
    "MicroBatchHost",
    "MicroBatcher",
    "PlanChoice",
    "check_memory_budget",
    "check_micro_batching",
    "custom_split",
    "split_call",
]

"""One finding of ``python -m speedups.lint``, and the tips and topics findings point to."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TOPICS", "Finding"]

TOPICS: dict[str, tuple[str, str]] = {
    "1": ("fast_loader", "docs/tips/fast-loader.md"),
    "2": ("tune_loader", "docs/tips/tune-loader.md"),
    "3": ("batch size", "docs/tips/memory.md"),
    "4": ("@accumulate", "docs/tips/accumulate.md"),
    "5": ("LossTracker", "docs/tips/loss-tracker.md"),
    "6": ("to_device", "docs/tips/to-device.md"),
    "7": ("mixed_precision", "docs/tips/mixed-precision.md"),
    "8": ("shard_model", "docs/tips/shard-model.md"),
    "9": ("ddp_wrap, distributed", "docs/tips/distributed.md"),
    "10": ("profiling", "docs/tips/profiling.md"),
    "checkpoints": ("checkpoints", "docs/checkpoints.md"),
    "compile_blocks": ("compile_blocks", "docs/gpu/compile-blocks.md"),
    "fast_kernels": ("fast_kernels", "docs/gpu/fast-kernels.md"),
    "migration": ("migration", "docs/migration.md"),
}
"""Each finding's topic: a tip's number (1-10) or a topic's name, with its name and docs page."""


@dataclass(frozen=True)
class Finding:
    """One place in a script and the tip that applies there.

    Attributes:
        path: the file, as given on the command line (or under a folder given).
        line: 1-based line of the place.
        topic: a key of :data:`TOPICS` (``"5"``, ``"checkpoints"``).
        message: what it costs and what to write instead, one sentence or two.
    """

    path: str
    line: int
    topic: str
    message: str

    def __str__(self) -> str:
        name, page = TOPICS[self.topic]
        label = f"tip {self.topic} ({name})" if self.topic.isdigit() else self.topic
        return f"{self.path}:{self.line}: {label}: {self.message} [{page}]"

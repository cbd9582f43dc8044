"""Tip 8: model parallel by submodule name (``shard_model``), its plan, and the hooks that move data."""

from speedups.sharding.shard import shard_model, unshard_model

__all__ = ["shard_model", "unshard_model"]

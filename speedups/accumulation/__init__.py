"""Tip 4: gradient accumulation (``@accumulate``), with its micro-batching and gradient-sync strategies."""

from speedups.accumulation.decorator import accumulate

__all__ = ["accumulate"]

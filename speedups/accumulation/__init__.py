"""Tip 4: gradient accumulation (``@accumulate``), with its micro-batching and gradient-sync strategies."""

from speedups.accumulation.decorator import accumulate
from speedups.accumulation.update_record import UpdateRecord

__all__ = ["UpdateRecord", "accumulate"]

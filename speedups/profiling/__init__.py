"""Tip 10: where the time goes (``profile_steps``), the classic mistakes (``check``), and advice."""

from speedups.profiling.checker import check
from speedups.profiling.profiler import StepProfiler, profile_steps

__all__ = ["StepProfiler", "check", "profile_steps"]

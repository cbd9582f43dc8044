"""The GPU's busy time on a sampled step, from its own activity records (see :class:`KernelTimer`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["KernelTimer", "busy_seconds"]


class KernelTimer:
    """On a sampled GPU step: the seconds each GPU spent running this step's kernels, copies and memsets.

    CUDA events around a step measure its span on the GPU, idle gaps included: in a loop bound by Python
    and kernel launches the span equals the host's step time, so it cannot say the GPU idled. The GPU's
    own activity records (``torch.profiler`` with ``ProfilerActivity.CUDA``: Kineto over CUPTI) give each
    kernel's start and end; their union per GPU is the busy time. The profiler runs on sampled steps only,
    and never over a profiler the user already runs (a second start would cancel theirs): then, or where
    the build has no CUDA activity tracing, there is no reading (``start`` returns None). The first trace
    in a process starts CUPTI: seconds, once (about 5 s on an H200 with torch 2.11); later ones cost
    milliseconds, on sampled steps only.
    """

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler

    @classmethod
    def start(cls) -> KernelTimer | None:
        """Start tracing GPU activity, or None where it cannot run (see the class)."""
        enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
        if (enabled is not None and enabled()) or (
            torch.profiler.ProfilerActivity.CUDA not in torch.profiler.supported_activities()
        ):
            return None
        try:
            with _quiet():
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                profiler.start()
        except RuntimeError:  # CUPTI refused (no permission, another tool holds it)
            return None
        return cls(profiler)

    def stop(self) -> float | None:
        """Stop tracing; the busiest GPU's busy seconds (overlapping kernels counted once), or None."""
        try:
            with _quiet():
                self.profiler.stop()
                events = self.profiler.events()
        except RuntimeError:
            return None
        spans: dict[int, list[tuple[float, float]]] = {}
        for event in events or ():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                rng = event.time_range
                spans.setdefault(event.device_index, []).append((rng.start, rng.end))
        if not spans:
            return None
        return max(busy_seconds(s) for s in spans.values())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch.profiler's notice that a profiler keeps one cycle's events (torch 2.11 warns it once a
    process starts a second profiler): each sampled step is its own cycle on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        yield


def busy_seconds(spans_us: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals in microseconds, in seconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans_us):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6

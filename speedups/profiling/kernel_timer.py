"""The GPU's activity on a sampled step, from its own activity records (see :class:`KernelTimer`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from speedups.profiling.gpu_activity import DeviceEvent, GpuActivity, event_kind, read_activity

__all__ = ["KernelTimer"]


class KernelTimer:
    """On a sampled GPU step: the seconds each GPU spent running this step's kernels, copies and memsets.

    CUDA events around a step measure its span on the GPU, idle gaps included: in a loop bound by Python
    and kernel launches the span equals the host's step time, so it cannot say the GPU idled. The GPU's
    own activity records (``torch.profiler`` with ``ProfilerActivity.CUDA``: Kineto over CUPTI) give each
    kernel's start and end, stream and name; their union per GPU is the busy time, and
    :func:`~speedups.profiling.gpu_activity.read_activity` sorts the busiest GPU's work. The profiler runs
    on sampled steps only, and never over a profiler the user already runs (a second start would cancel
    theirs): then, or where the build has no CUDA activity tracing, there is no reading (``start`` returns
    None). The first trace in a process starts CUPTI: seconds, once (about 5 s on an H200 with torch 2.11);
    later ones cost milliseconds, on sampled steps only.
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

    def stop(self) -> GpuActivity | None:
        """Stop tracing; what the busiest GPU did (see :class:`GpuActivity`), or None without a trace."""
        try:
            with _quiet():
                self.profiler.stop()
                events = self.profiler.events()
        except RuntimeError:
            return None
        return read_activity(
            DeviceEvent(
                event.name,
                event.device_index,
                _stream(event),
                event.time_range.start,
                event.time_range.end,
                event_kind(event.name),
            )
            for event in events or ()
            if event.device_type == torch.autograd.DeviceType.CUDA
        )


def _stream(event: Any) -> int:
    """The stream a device event ran on: its ``device_resource_id``, which FunctionEvent lacks before about
    torch 2.4 and then keeps as its ``thread`` (as torch's own default for the field does)."""
    stream = getattr(event, "device_resource_id", None)
    return int(event.thread if stream is None else stream)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch.profiler's notice that a profiler keeps one cycle's events (torch 2.11 warns it once a
    process starts a second profiler): each sampled step is its own cycle on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        yield

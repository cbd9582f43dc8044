"""How a :class:`~speedups.data.prefetching.DevicePrefetcher` moves a batch: the interface of its strategies.

The prefetcher owns the order (which batch is drawn, copied and handed out when, and the loader's position);
a strategy owns the mechanism (a CUDA side stream and its events, or nothing at all). A new mechanism is one
class with these three members, in its own file.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["BatchCopy"]


@runtime_checkable
class BatchCopy(Protocol):
    """Start a batch's copy to the device, and later make it safe for the step to use.

    Attributes:
        ahead: how many batches the prefetcher draws and starts beyond the one it hands out: 1 for a copy
            that runs while the step computes (a side stream), 0 for one done at hand-out.
    """

    ahead: int

    def start(self, batch: Any) -> Any:
        """Issue the copy of ``batch`` (as drawn from the loader) and return a handle for :meth:`finish`.

        No sync: a copy that can run in the background is only queued here.
        """
        ...

    def finish(self, handle: Any) -> Any:
        """Return the moved batch of ``handle``, made safe to use on the step's (current) stream.

        Called just before the batch is handed to the step, in the order the batches were started.
        """
        ...

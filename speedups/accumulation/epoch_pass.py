"""The epochs of one ``@accumulate`` step: ``train_step.epoch(loader)`` passes, whose last window is flushed.

A window never straddles two epochs: ``epoch(batches)`` yields the batches and applies the short last window
when they are exhausted. A window saved inside a pass belongs to it: after a resume, the next pass over a
:class:`~speedups.DistributedLoader` restored with the checkpoint continues that window (the loader resumes
the same epoch mid-way); any other pending window refuses a new pass, since a loop broke out without flush.
The pass also records which loader feeds the step (its layout), so a resume on another number of processes
can check the global batch; and, for FSDP2, marks a sized pass's last call, whose backward must sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from speedups.data.distributed_loader import DistributedLoader
from speedups.data.prefetching import DevicePrefetcher
from speedups.errors import SpeedupsError

__all__ = ["EpochPass"]

T = TypeVar("T")


class EpochPass:
    """The state of a step's ``epoch()`` passes.

    Attributes:
        running: True while a pass runs (a window then belongs to it).
        closes: the current call is the last of a sized pass (FSDP2 syncs it; see ``sized``).
        resumed: the restored window was saved inside a pass.
        feed: the layout (``batch_size``, ``samples``, ``world_size``) of the DistributedLoader a pass
            iterates, or None.
    """

    def __init__(self, *, sized: bool) -> None:
        self.sized = sized  # whether a pass marks its last call (FSDP2 needs its backward to sync)
        self.running = False
        self.closes = False
        self.resumed = False
        self.feed: dict[str, int] | None = None

    def run(self, batches: Iterable[T], pending: int, flush: Callable[[], None]) -> Iterator[T]:
        """Yield from ``batches`` and call ``flush()`` when they are exhausted (``pending``: the calls of the
        window open when the pass starts).

        Raises:
            SpeedupsError: a window of an earlier epoch is still pending (a loop broke out without flush()).
        """
        if pending:
            self._check_continues(batches, pending)
        loader = _positioned(batches)
        if loader is not None:  # which loader feeds this step (a resume on another
            layout = loader.state_dict()  # number of processes checks the global batch with it)
            self.feed = {k: layout[k] for k in ("batch_size", "samples", "world_size")}
        self.resumed = False
        self.running = True
        size = _length(batches) if self.sized else None
        try:
            for i, batch in enumerate(batches):
                self.closes = i + 1 == size  # its backward must sync: the flush below applies it
                yield batch
        finally:
            self.running = self.closes = False
        flush()

    def _check_continues(self, batches: Any, pending: int) -> None:
        """Refuse to start a pass over a pending window unless it was restored from this epoch.

        A window saved inside ``epoch()`` belongs to that epoch; a :class:`DistributedLoader` restored with it
        resumes that epoch mid-way (at least ``pending`` batches in), which is what tells the two apart.
        """
        loader = _positioned(batches)
        position = None if loader is None else loader.state_dict()
        if self.resumed and (position is None or position["batches"] >= pending):
            return
        where = ""
        if self.resumed and position is not None:
            where = (
                f" The checkpoint was taken inside an epoch, but the loader starts epoch {position['epoch']} "
                f"at batch {position['batches']}: load it with the checkpoint too (loader=loader) so it "
                f"resumes where the window was saved."
            )
        raise SpeedupsError(
            f"accumulate(...).epoch(loader): {pending} micro-steps of an earlier epoch are still "
            f"pending. Call train_step.flush() before starting a new epoch.{where}"
        )

    def state_dict(self, pending: int) -> dict[str, Any]:
        """The pass's part of a step's checkpoint state, with ``pending`` calls in the open window."""
        return {"in_epoch": bool(self.running and pending), "feed": self.feed}

    def load_state_dict(self, state: dict[str, Any], pending: int) -> None:
        """Restore what :meth:`state_dict` returned (the step checked it)."""
        self.resumed = bool(state.get("in_epoch", False)) and pending > 0
        self.feed = state.get("feed")


def _positioned(batches: Any) -> DistributedLoader | None:
    """The :class:`DistributedLoader` ``batches`` is, or that a ``prefetch_to_device`` over it wraps."""
    loader = batches.loader if isinstance(batches, DevicePrefetcher) else batches
    return loader if isinstance(loader, DistributedLoader) else None


def _length(batches: Any) -> int | None:
    """``len(batches)``, or None for an iterable without a length (a generator, an iterable dataset's)."""
    try:
        return len(batches)
    except TypeError:
        return None

"""Batches already on the device when the step asks for them: the next one is copied while the step runs.

:func:`prefetch_to_device` wraps any loader (a ``DataLoader``, ``fast_loader(...)``, ``distributed(...)``'s
:class:`~speedups.DistributedLoader`, a list of batches). On CUDA, batch i+1's copy from pinned memory is
queued on a side stream before batch i is handed to the step, so the host-to-device copy overlaps the step's
kernels instead of preceding them; elsewhere the batches pass through. A ``DistributedLoader``'s position
only moves when a batch is handed out, so a checkpoint taken mid-epoch neither skips nor repeats the batch
drawn ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from speedups._helpers import validate
from speedups._helpers.moving import DeviceLike
from speedups.data.distributed_loader import DistributedLoader
from speedups.data.prefetching.batch_copy import BatchCopy
from speedups.data.prefetching.pass_through import PassThrough
from speedups.data.prefetching.side_stream import SideStreamCopy
from speedups.device import resolve_device

__all__ = ["DevicePrefetcher", "prefetch_to_device"]


class DevicePrefetcher:
    """A loader whose batches come out on the device, each copied while the step before it ran.

    Made by :func:`prefetch_to_device`. Each ``iter()`` is a new pass of the loader (a new epoch for a
    :class:`~speedups.DistributedLoader`); ``len()`` and every other attribute (``set_epoch``, ``epoch``,
    ``state_dict``, ``sampler``, ``dataset``, ...) are the loader's. Save and load the loader or this object
    with a checkpoint (``save_checkpoint(..., loader=loader)``): either records the position of the batches
    handed to the step, not of the one drawn ahead.

    Args:
        loader: an iterable that starts a new pass at each ``iter()``.
        strategy: how a batch is moved (:class:`~speedups.data.prefetching.SideStreamCopy` on CUDA,
            :class:`~speedups.data.prefetching.PassThrough` elsewhere, or your own
            :class:`~speedups.data.prefetching.BatchCopy`).

    Raises:
        TypeError: ``loader`` is no such iterable (an iterator, a generator, a tensor, a string, a dataset),
            or ``strategy`` is no :class:`~speedups.data.prefetching.BatchCopy`.
        ValueError: ``loader`` already prefetches, or ``strategy.ahead`` is not an int >= 0.
    """

    def __init__(self, loader: Iterable[Any], strategy: BatchCopy) -> None:
        said = f"DevicePrefetcher(loader=<{type(loader).__name__}>, strategy={validate.short(strategy)})"
        _check_loader(said, loader)
        if not isinstance(strategy, BatchCopy):
            raise TypeError(
                f"{said}: strategy must have ahead (an int), start(batch) and finish(handle), as "
                f"speedups.data.prefetching.BatchCopy says. Use prefetch_to_device(loader, device)."
            )
        with validate.arguments(said):
            validate.integer(strategy.ahead, "strategy.ahead", minimum=0, example="1")
        self.loader = loader
        self.strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.strategy, PassThrough) and not self.strategy.moves:
            return iter(self.loader)  # nothing to move: the loader's own iterator, no layer in between
        if isinstance(self.loader, DistributedLoader):  # its position moves only when a batch is handed out
            counting = iter(self.loader)
            return _Ahead(self.strategy, counting.draw, counting.advance, counting.end)
        inner = iter(self.loader)
        return _Ahead(self.strategy, inner.__next__, _nothing, _nothing)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if name.startswith("_") or loader is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(loader, name)

    def __repr__(self) -> str:
        return f"DevicePrefetcher({type(self.loader).__name__}, {self.strategy!r})"


def _nothing() -> None:
    return None


class _Ahead:
    """One pass: draws ``strategy.ahead`` batches beyond the one it hands out, in the loader's order."""

    def __init__(
        self,
        strategy: BatchCopy,
        draw: Callable[[], Any],
        advance: Callable[[], None],
        end: Callable[[], None],
    ) -> None:
        self._strategy, self._ahead = strategy, strategy.ahead
        self._draw, self._advance, self._end = draw, advance, end
        self._started: deque[Any] = deque()  # handles of the batches drawn and started, oldest first
        self._exhausted = False

    def __iter__(self) -> _Ahead:
        return self

    def __next__(self) -> Any:
        while not self._exhausted and len(self._started) <= self._ahead:
            try:
                batch = self._draw()
            except StopIteration:
                self._exhausted = True
            else:
                self._started.append(self._strategy.start(batch))
        if not self._started:
            self._end()  # the step has had every batch: now the pass is over
            raise StopIteration
        batch = self._strategy.finish(self._started.popleft())
        self._advance()
        return batch


def _check_loader(said: str, loader: Any) -> None:
    """Raise unless ``loader`` is an iterable that starts a new pass at each ``iter()``."""
    if isinstance(loader, DevicePrefetcher):
        raise ValueError(f"{said}: this loader already prefetches to {loader.strategy!r}. Pass it as it is.")
    fix = (
        "Pass the loader itself, e.g. prefetch_to_device(DataLoader(dataset, batch_size=64, "
        "pin_memory=True)); with @accumulate: for batch in train_step.epoch(prefetch_to_device(loader))."
    )
    if isinstance(loader, Iterator):
        raise TypeError(
            f"{said}: loader is an iterator ({type(loader).__name__}), which runs one pass only and would "
            f"lose the batch drawn ahead when the loop breaks. Expected a loader that starts a new pass at "
            f"each iter(). {fix}"
        )
    if isinstance(loader, (str, bytes, torch.Tensor, Mapping)) or not isinstance(loader, Iterable):
        raise TypeError(
            f"{said}: loader={validate.short(loader, 40)} is not a loader. Expected an iterable of batches "
            f"that starts a new pass at each iter() (a DataLoader, fast_loader(...), distributed(...), a "
            f"list of batches). {fix}"
        )


def prefetch_to_device(loader: Iterable[Any], device: DeviceLike | None = None) -> DevicePrefetcher:
    """Return ``loader`` with its batches on ``device``, each copied while the step before it runs.

    On CUDA the copy of batch i+1 is queued on a side stream (from pinned memory: build the loader with
    ``pin_memory=True``, as ``fast_loader`` does) before batch i is handed out, and the step's stream waits
    for it on the GPU, so the copy hides behind the step's kernels: it helps when copies are a visible share
    of the step (large inputs, a short step), not when the loader's workers are the bottleneck. One extra
    batch lives on the device. A batch comes out as ``to_device(batch, device)`` would make it (same values,
    containers and dtypes). On the CPU the loader's own batches and iterator pass through at no cost; on
    another device (``mps``) each batch is moved by ``to_device`` when handed out. Technique: NVIDIA apex's
    ImageNet ``data_prefetcher``, torchtnt's ``CudaDataPrefetcher``.

    Sync points: none with pinned memory (a copy from pageable memory blocks the host for that copy).

    Args:
        loader: a ``DataLoader``, ``fast_loader(...)``, ``distributed(...)``, or any iterable of batches that
            starts a new pass at each ``iter()``. Resume-safe with a ``DistributedLoader``: its saved position
            is the batches handed to the step. Wrap the loader, then the epoch:
            ``train_step.epoch(prefetch_to_device(loader))``.
        device: the target; None is this process's device (``cuda:LOCAL_RANK``, else ``mps``, else ``cpu``).

    Returns:
        A :class:`DevicePrefetcher`.

    Raises:
        TypeError: ``loader`` is not such an iterable (an iterator or generator, a tensor, a dataset), or
            ``device`` has the wrong type.
        ValueError: ``device`` is not a device name, or is ``meta`` (no data), or ``loader`` already
            prefetches.
        SpeedupsError: ``device`` does not exist on this machine (the message lists those that do).

    Example:
        >>> batches = [{"x": torch.ones(2, 3)}, {"x": torch.zeros(2, 3)}]
        >>> [b["x"].sum().item() for b in prefetch_to_device(batches, "cpu")]
        [6.0, 0.0]
    """
    said = f"prefetch_to_device(loader=<{type(loader).__name__}>, device={device!r})"
    _check_loader(said, loader)
    target = resolve_device(device, call="prefetch_to_device")
    if target.type == "meta":
        raise ValueError(
            f"{said}: the meta device holds shapes, no data, so every batch would come out empty. Pass the "
            f"device the step runs on: prefetch_to_device(loader) picks cuda:LOCAL_RANK, else mps, else cpu."
        )
    strategy: BatchCopy = SideStreamCopy(target) if target.type == "cuda" else PassThrough(target)
    return DevicePrefetcher(loader, strategy)

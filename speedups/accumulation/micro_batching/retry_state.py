"""What a call's forward changes besides gradients, kept so that a retry after out of memory starts anew.

Under ``micro_batch_size="auto"`` a call that runs out of memory runs again at half the size. The failed try
has already changed state a forward changes: BatchNorm's running statistics and ``num_batches_tracked``
(written by its kernels without moving their version counters), any other buffer a forward writes in place,
and the random number streams its dropout drew from. The retry must start from the state the failed try
found, as ``torch.utils.checkpoint`` restores the RNG states for its recompute and
:mod:`speedups.memory.recompute` the written buffers: then the run is the hand loop's at the size found.

:class:`RetryState` takes, before each try, the global RNG states (torch's CPU and device generators,
``random``, numpy) and the buffers a forward may write, and puts them back before a retry. Which buffers:
on the batcher's first call, every buffer of the modules the call runs (the model's, with ``model=``; else
those a forward hook sees run, for that call only); from then on, the running statistics of the norm layers
among them and the buffers whose version counter that call moved. A few small copies per call (one per
BatchNorm statistic), and none of a large constant buffer (a causal mask).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speedups._helpers import compat
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups._helpers.wrappers import unwrap

__all__ = ["RetryState"]

Taken = tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]
"""The RNG states and ``(buffer, copy)`` pairs taken before a try."""


class RetryState:
    """The state a try of a call starts from: taken before each try, put back before a retry.

    Args:
        model: the step's model (``accumulate(..., model=)``), or None: the modules are found on the first
            call by a forward pre-hook on every module, for that call only.
    """

    def __init__(self, model: nn.Module | None) -> None:
        self._model = None if model is None else unwrap(model)
        self._watched: list[torch.Tensor] | None = None  # the buffers copied per try, once learnt
        self._learning: _Learning | None = None

    def take(self) -> Taken:
        """Copy what the try about to run may change; on the first call, start learning what that is."""
        rng = get_rng_states()
        if self._watched is not None:
            return rng, [(b, b.detach().clone()) for b in self._watched]
        if self._learning is None:
            self._learning = _Learning(self._model)
        return rng, self._learning.start()

    def put_back(self, taken: Taken) -> None:
        """Before a retry: the RNG states and buffers as :meth:`take` found them."""
        rng, buffers = taken
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        set_rng_states(rng)

    def pause(self) -> None:
        """The try failed: stop watching modules run (the next try, or call, watches again)."""
        if self._learning is not None:
            self._learning.stop()

    def done(self) -> None:
        """The try succeeded: after the first call, keep copying only what it showed a forward writes."""
        learning = self._learning
        if learning is None:
            return
        learning.stop()
        self._watched = learning.written()
        self._learning = None


class _Learning:
    """The first call's watch: every buffer of the modules it runs, copied before they run."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model
        self.seen: dict[int, tuple[nn.Module, list[tuple[torch.Tensor, int]]]] = {}
        self.handle: Any = None
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy the buffers of the modules known (``model=``, or seen by an earlier try of this call) now,
        and of the others as they first run."""
        self.copies = []
        known = self.model.modules() if self.model is not None else [m for m, _ in self.seen.values()]
        for module in known:
            self._see(module)
        if self.model is None and self.handle is None:
            self.handle = nn.modules.module.register_module_forward_pre_hook(self._pre_forward)
        return self.copies

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self.seen:
            self._see(module)

    def _see(self, module: nn.Module) -> None:
        own = list(module.buffers(recurse=False))
        self.seen[id(module)] = (module, [(b, compat.grad_version(b)) for b in own])
        self.copies.extend((b, b.detach().clone()) for b in own)

    def written(self) -> list[torch.Tensor]:
        """The running statistics of norm layers seen, and the buffers whose version the call moved."""
        out: dict[int, torch.Tensor] = {}
        for module, buffers in self.seen.values():
            norm = getattr(module, "track_running_stats", False) is True
            for buffer, version in buffers:
                if norm or compat.grad_version(buffer) != version:
                    out.setdefault(id(buffer), buffer)
        return list(out.values())

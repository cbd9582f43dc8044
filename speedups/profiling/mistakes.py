"""Catch the classic training-loop mistakes while the loop runs: the detectors behind :func:`~speedups.check`.

A loss kept alive with its autograd graph, a ``DistributedSampler`` replaying the same epoch, and a
``no_sync()`` that covers backward but not forward. Each warns once (a ``SpeedupsWarning``) with the fix as
code. The detectors live in :class:`MistakeWatcher`, which a ``StepProfiler`` made with ``debug=True`` feeds
as the loop runs; :func:`~speedups.check` is that profiler.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from speedups._helpers.tree import tree_map
from speedups._helpers.wrappers import find_ddp
from speedups.data.persistence import unwrapped
from speedups.errors import SpeedupsWarning

__all__ = ["MistakeWatcher"]


class MistakeWatcher:
    """The mistake detectors of one checker, fed by its profiler; each warns once.

    ``start()``/``stop()`` install and remove the ``no_sync`` detector's hook on ``model`` (a DDP model;
    any other model is not watched for it). The profiler calls :meth:`new_pass` with each iterable it starts
    iterating and :meth:`step_ended` after each step.
    """

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model
        self.active = False
        """True between ``start()`` and ``stop()``."""
        self._warned: set[str] = set()
        self._loss_refs: list[list[weakref.ref[torch.Tensor]]] = []
        self._sampler_epochs: dict[int, int] = {}
        self._hooks: list[Any] = []

    def start(self) -> None:
        """Begin watching: install the ``no_sync`` detector on the model if it is a DDP model."""
        self.active = True
        if self.model is not None:
            self._install_no_sync_detector(self.model)

    def stop(self) -> None:
        """Stop watching: remove every hook this watcher installed."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.active = False

    def _warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, SpeedupsWarning, stacklevel=4)

    def step_ended(self, loss_refs: list[weakref.ref[torch.Tensor]] | None) -> None:
        """After a step: ``loss_refs`` are weak references to the scalars with a graph made in it, if sampled.

        At the end of step k, the scalars with graphs made during step k-1 should be gone: the loop's `loss`
        variable now names step k's loss. One still alive was stored somewhere.
        """
        if loss_refs is not None:
            self._loss_refs.append(loss_refs)
        while len(self._loss_refs) > 1:
            old = self._loss_refs.pop(0)
            if any((t := r()) is not None and t.grad_fn is not None for r in old):
                self._warn_once(
                    "kept-graph",
                    "speedups.check: a loss tensor from an earlier step is still alive with its "
                    "autograd graph (e.g. `losses.append(loss)`), which keeps that step's activations in "
                    "memory. Fix: `losses.append(loss.detach())`, or `tracker = LossTracker(); "
                    "tracker.update(loss)`.",
                )

    def new_pass(self, iterable: Iterable[Any]) -> None:
        """A pass over ``iterable`` began: warn if its ``DistributedSampler`` has the last pass's epoch."""
        sampler = unwrapped(getattr(iterable, "sampler", None))  # the user's, inside fast_loader's wrappers
        batch_sampler = unwrapped(getattr(iterable, "batch_sampler", None))
        if not isinstance(sampler, torch.utils.data.DistributedSampler):
            sampler = unwrapped(getattr(batch_sampler, "sampler", None))
        if not isinstance(sampler, torch.utils.data.DistributedSampler):
            return
        epoch = int(sampler.epoch)
        if self._sampler_epochs.get(id(sampler)) == epoch:
            self._warn_once(
                "sampler-epoch",
                f"speedups.check: the DistributedSampler was iterated again with the same epoch "
                f"({epoch}), so every epoch replays the same order. Fix: call "
                f"`loader.sampler.set_epoch(epoch)` before each epoch, or `loader = distributed(loader)`, "
                f"which does it for you.",
            )
        self._sampler_epochs[id(sampler)] = epoch

    def _install_no_sync_detector(self, model: torch.nn.Module) -> None:
        ddp = find_ddp(model)  # also inside torch.compile, in either order
        if ddp is None:
            return

        def after_forward(module: Any, args: Any, output: Any) -> None:
            synced_forward = bool(module.require_backward_grad_sync) and torch.is_grad_enabled()
            leaf = _first_grad_tensor(output)
            if leaf is None or not synced_forward:
                return

            def at_backward(grad: torch.Tensor) -> None:
                if not module.require_backward_grad_sync:
                    self._warn_once(
                        "no-sync-forward",
                        "speedups.check: backward ran inside `model.no_sync()` but forward did "
                        "not, so DDP still all-reduces this micro-step. Fix: put the forward inside too: "
                        "`with model.no_sync(): loss = loss_fn(model(x), y); loss.backward()`, or use "
                        "@accumulate, which does it for you.",
                    )

            leaf.register_hook(at_backward)

        self._hooks.append(ddp.register_forward_hook(after_forward))


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in ``obj`` (any nesting) that requires grad, or None."""
    found: list[torch.Tensor] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            found.append(leaf)
        return leaf

    tree_map(visit, obj)
    return found[0] if found else None

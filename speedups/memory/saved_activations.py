"""Count the bytes of activations a training step keeps for backward, per block of the model.

Inside ``with SavedActivations(model) as saved:``, a ``torch.autograd.graph.saved_tensors_hooks`` pair sees
every tensor autograd saves for backward (PyTorch doc, "Hooks for saved tensors") and hands it back
unchanged. It counts each storage once (a view of a counted storage adds nothing), leaves out the model's
parameters and buffers (they are held anyway), and adds the bytes to the block whose forward was running
(see :mod:`speedups.memory.blocks`), or to ``OUTSIDE`` (the loss, code between blocks). It also follows the
bytes still held: a tensor counts until autograd lets it go (after its backward), so ``peak_bytes`` is the
most held at once, which is what a micro-batched step needs. A checkpointed block's own saves go to torch's
checkpoint and are not seen: what it keeps (its inputs) is. Exact and device-independent: it works on the
CPU as on a GPU. It adds a Python call per saved tensor, so it is for a measured step, not every step.
Under ``torch.compile`` the block hooks are seen only by code compiled after they were added (dynamo does
not guard on hooks): bytes of blocks compiled before count as ``OUTSIDE``.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from speedups._helpers import compat
from speedups._helpers.wrappers import unwrap
from speedups.memory.blocks import model_blocks
from speedups.memory.recompute import ATTR

__all__ = ["OUTSIDE", "SavedActivations"]

OUTSIDE = "(outside blocks)"


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, or a tensor subclass without storage
        return None
    ptr = storage.data_ptr()
    return None if ptr == 0 else (str(t.device), ptr)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class SavedActivations:
    """Bytes saved for backward during a ``with`` block, per block of ``model``, and forward time per block.

    Attributes:
        bytes_by_block: ``{block name: bytes}`` saved while that block's forward ran (summed over its calls).
        input_bytes: ``{block name: bytes}`` of the tensors handed to the block (summed over its calls): about
            what it still keeps when checkpointed.
        seconds_by_block: ``{block name: seconds}`` of host wall time in its forward (summed over its calls;
            on a GPU the host time of launching its kernels, unless the caller synchronises).
        calls_by_block: ``{block name: calls}``.
        total_bytes: every byte counted (the blocks' and ``OUTSIDE``'s).
        peak_bytes: the most bytes held for backward at one time.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = unwrap(model)
        self.blocks = model_blocks(model)
        self.bytes_by_block: dict[str, int] = {name: 0 for name, _ in self.blocks}
        self.bytes_by_block[OUTSIDE] = 0
        self.input_bytes: dict[str, int] = {name: 0 for name, _ in self.blocks}
        self.seconds_by_block: dict[str, float] = {name: 0.0 for name, _ in self.blocks}
        self.calls_by_block: dict[str, int] = {name: 0 for name, _ in self.blocks}
        self.total_bytes = 0
        self.peak_bytes = 0
        self._held = 0
        self._stack: list[tuple[str, float]] = []
        self._seen: dict[tuple[str, int], weakref.ref[torch.Tensor]] = {}
        self._excluded: set[tuple[str, int]] = set()
        self._exit: ExitStack | None = None

    def __enter__(self) -> SavedActivations:
        self._excluded = {
            key
            for t in (*self.model.parameters(), *self.model.buffers())
            if (key := _storage_key(t)) is not None
        }
        stack = ExitStack()
        for name, block in self.blocks:
            stack.enter_context(self._timed(name, block))
        compat.leave_to_eager(SavedActivations._pack, _unpack)  # run from autograd: never compiled
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        self._exit = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._exit is not None:
            self._exit.close()
            self._exit = None

    # ------------------------------------------------------------------------------------------- hooks
    @contextmanager
    def _timed(self, name: str, block: nn.Module) -> Iterator[None]:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            if _recomputing(module):
                return  # torch runs a checkpointed block again in backward: not a forward of the step
            self._stack.append((name, time.perf_counter()))
            self.input_bytes[name] += sum(_nbytes(a) for a in args if isinstance(a, torch.Tensor))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._stack and self._stack[-1][0] == name:
                _, start = self._stack.pop()
                self.seconds_by_block[name] += time.perf_counter() - start
                self.calls_by_block[name] += 1

        if "torch._dynamo" in sys.modules:  # under torch.compile: run as they are (a graph break), untraced
            enter, leave = torch.compiler.disable(enter), torch.compiler.disable(leave)
        # First of the pre-hooks, so the inputs a checkpoint keeps (saved in its own pre-hook) count here.
        handles = [
            block.register_forward_pre_hook(enter, prepend=True),
            block.register_forward_hook(leave, always_call=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is None or key in self._excluded:
            return t
        earlier = self._seen.get(key)
        if earlier is not None and earlier() is not None:
            return t  # this storage is counted (and held) already
        size = _nbytes(t)
        self._seen[key] = weakref.ref(t, self._release(size))
        self.total_bytes += size
        self._held += size
        self.peak_bytes = max(self.peak_bytes, self._held)
        block = self._stack[-1][0] if self._stack else OUTSIDE
        self.bytes_by_block[block] += size
        return t

    def _release(self, size: int) -> Any:
        def released(_: object) -> None:
            self._held -= size

        return released


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _recomputing(module: nn.Module) -> bool:
    recompute = getattr(module, ATTR, None)
    return recompute is not None and recompute.recomputing > 0

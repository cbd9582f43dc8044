"""The two hooks that make one module recompute its activations in backward instead of keeping them.

A forward pre-hook opens torch's non-reentrant checkpoint region around the module's call
(:func:`speedups._helpers.compat.checkpoint_region`, the generator behind ``torch.utils.checkpoint`` and
torch's composable ``checkpoint``) and a forward hook closes it: inside, the tensors autograd would save are
replaced by handles, and the first backward that needs one runs the module again, with the CPU and device
RNG states of the forward restored (dropout draws the same masks) and the same autocast state. Nothing of the
module is replaced: both hooks are removable handles (``STYLE.md``: no monkey patching).

Buffers a forward writes (BatchNorm's running statistics and ``num_batches_tracked``) would be written again
by the recompute. The hooks put them back after each recompute, so they end as a plain run leaves them: the
running statistics of every norm layer in training mode that tracks them (torch's batch-norm kernels update
them without bumping their version counters, so they are known by their layer), and any other buffer whose
version counter a forward of the module moved.

The forward inside the region runs as the recompute will, since torch's checkpoint compares what each saves
(count, shapes, dtypes) and raises ``CheckpointError`` when they differ: AOT autograd (inductor, aot_eager)
saves other tensors than eager autograd. torch runs the recompute with dynamo off, so the forward of a module
inside a whole-model ``torch.compile`` is made eager; a module whose own call is compiled (``compile_blocks``,
``module.compile()``) runs that compiled call in the recompute too (its ``torch.compile`` wrapper turns dynamo
back on), so its forward is left compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
from torch import nn

from speedups._helpers import compat

__all__ = ["ATTR", "Recompute"]

ATTR = "_speedups_recompute"  # the Recompute of a checkpointed module, kept on the module itself


class Recompute:
    """The checkpoint hooks of one module (``module._speedups_recompute``); :meth:`remove` takes them off.

    Attributes:
        name: the module's dotted name in the model it was picked from.
        recomputing: > 0 while torch runs this module again in backward (the hooks then stand aside).
        written: the buffers a forward of the module writes in place (found on its forwards), restored after
            each recompute.
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        self.name = name
        self.recomputing = 0
        self._regions: list[tuple[Generator[None, None, None], Any] | None] = []
        self._buffers = list(module.buffers())
        self._norms = [m for m in module.modules() if _tracks_running_stats(m)]
        self._versions: list[list[int]] = []
        self.written: list[torch.Tensor] = []
        enter, leave = compat.outside_compile(self._enter, self._exit)  # torch.compile runs them as they are
        self._handles = [
            module.register_forward_pre_hook(enter, with_kwargs=True),
            # First of the forward hooks, as torch's composable checkpoint does: other hooks (FSDP2's) run
            # outside the region.
            module.register_forward_hook(leave, with_kwargs=True, prepend=True, always_call=True),
        ]

    def remove(self) -> None:
        """Take both hooks off (a call in flight finishes as it began)."""
        for handle in self._handles:
            handle.remove()

    # ---------------------------------------------------------------------------------------- the hooks
    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.recomputing or not torch.is_grad_enabled():
            self._regions.append(None)
            return
        if self._buffers:
            self._versions.append([compat.grad_version(b) for b in self._buffers])
        region = compat.checkpoint_region(module, args, kwargs, self._contexts)
        # The forward runs as the recompute will, or the recompute saves other tensors and torch's checkpoint
        # raises CheckpointError: torch runs the recompute with dynamo off (eagerly), except a module whose
        # own call is compiled (compile_blocks, module.compile()): its compiled call turns dynamo back on.
        own = compat.has_compiled_call(module)
        frames = compat.NOT_COMPILING if own else compat.eager_frames()
        next(region)
        self._regions.append((region, frames))

    def _exit(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        entry = self._regions.pop() if self._regions else None
        if entry is None:
            return
        region, frames = entry
        try:
            with contextlib.suppress(StopIteration):
                next(region)
        finally:
            compat.restore_frames(frames)
        if self._buffers and self._versions:
            before = self._versions.pop()
            for buf, version in zip(self._buffers, before, strict=True):
                if compat.grad_version(buf) != version and not _among(buf, self.written):
                    self.written.append(buf)

    def _contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        return contextlib.nullcontext(), _Recomputing(self)

    def enter_recompute(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recompute starts: the hooks stand aside; returns the written buffers' values, to put back."""
        stats = [b for m in self._norms if m.training for b in _running_stats(m)]
        written = (w for w in self.written if not _among(w, stats))
        self.recomputing += 1
        return [(b, b.detach().clone()) for b in (*stats, *written)]

    def exit_recompute(self, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The recompute ended: the hooks act again and the written buffers are as they were before it."""
        self.recomputing -= 1
        with torch.no_grad():
            for buf, value in kept:
                buf.copy_(value)


class _Recomputing:
    """The context of one module's recomputes (torch's ``context_fn`` second context): entered once per
    recompute, so once per backward through the module (``retain_graph=True``, a gradient penalty)."""

    def __init__(self, owner: Recompute) -> None:
        self.owner = owner
        self.kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> None:
        self.kept.append(self.owner.enter_recompute())

    def __exit__(self, *exc: object) -> None:
        self.owner.exit_recompute(self.kept.pop())


def _tracks_running_stats(module: nn.Module) -> bool:
    """A norm layer that updates running statistics in training (BatchNorm, InstanceNorm with tracking)."""
    return getattr(module, "track_running_stats", False) is True and isinstance(
        getattr(module, "running_mean", None), torch.Tensor
    )


def _running_stats(module: nn.Module) -> list[torch.Tensor]:
    names = ("running_mean", "running_var", "num_batches_tracked")
    return [b for n in names if isinstance(b := getattr(module, n, None), torch.Tensor)]


def _among(tensor: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return any(tensor is t for t in tensors)

"""The DDP strategy: ``no_sync()`` inside a window, and an explicit all-reduce for a flushed short window."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from speedups.accumulation.grad_sync.base import (
    NULL_CONTEXT,
    DataParallelSync,
    LocalCount,
    SyncKind,
    count_dtype,
)
from speedups.errors import SpeedupsError

__all__ = ["DDPSync"]


class DDPSync(DataParallelSync):
    """``DistributedDataParallel``: the calls inside a window run in ``no_sync()``; a flush all-reduces.

    With ``find_unused_parameters=True``, DDP counts a parameter as used from the first ``no_sync()`` backward
    that reached it until its next synchronised backward; a flushed window never reaches that backward, so
    DDP still counts its parameters as used in the next window (and refuses an undefined gradient for them).
    After a flush each of those keeps a zero gradient, and every rank notes which parameters really get one
    until the next update: there, one small all-reduce of those notes (once per flush, never per micro-step)
    tells every rank which parameters no rank used; their gradients go back to None, as DDP leaves them.
    """

    kind = SyncKind.DDP

    def __init__(self, model: DistributedDataParallel) -> None:
        super().__init__(model, dist.get_world_size(model.process_group), model.process_group)
        self.find_unused = bool(getattr(model, "find_unused_parameters", False))
        self.used: dict[int, list[bool]] = {}  # id(param) -> [really got a gradient], after a flush
        self.handles: list[Any] = []
        self.stale: list[torch.Tensor] = []  # had a gradient in the flushed window, on this rank
        self.buffers_due = False  # a flush ended the last window: the next call broadcasts the buffers

    def check_window(self, every: int, micro_batches: bool) -> None:
        """Refuse a window over a ``DDP(static_graph=True)`` that has not had its first synchronised backward.

        DDP learns a static graph in the first backward it reduces; a ``no_sync()`` backward before that
        fails inside PyTorch's reducer ("expect_autograd_hooks_ INTERNAL ASSERT FAILED",
        pytorch/pytorch#143580, plain PyTorch too), and a window's calls before its boundary (and a split
        call's micro-batches) run in ``no_sync()``. A static graph that already ran is accepted.

        Raises:
            SpeedupsError: ``every`` > 1 or micro-batching over such a model (the message names the fix).
        """
        ddp = self.model
        learnt = getattr(ddp, "_static_graph_delay_allreduce_enqueued", True)  # its first reduce ran
        if (every == 1 and not micro_batches) or not getattr(ddp, "static_graph", False) or learnt:
            return
        what = f"accumulate({every}, ...)" if every > 1 else "accumulate(..., micro_batch_size=...)"
        raise SpeedupsError(
            f"{what} over DistributedDataParallel(static_graph=True): DDP learns a static graph from its "
            f"first synchronised backward, and the window's calls before its boundary run in no_sync(), "
            f"whose backward fails inside PyTorch's reducer before that "
            f"('expect_autograd_hooks_ INTERNAL ASSERT FAILED', pytorch/pytorch#143580). "
            f"Wrap the model without static_graph: ddp_wrap(model), or "
            f"find_unused_parameters=True where some parameters go unused; with accumulation DDP reduces "
            f"once per window, so a static graph saves little."
        )

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        self._buffers_if_due()
        return NULL_CONTEXT if boundary and not self.boundary_flushes else self.model.no_sync()

    def piece_step(self, boundary: bool, last: bool) -> AbstractContextManager[Any]:
        return self.model.no_sync()  # a split call's boundary reduces once, after its last micro-batch

    def split_call_starts(self, syncs: bool) -> None:
        self._buffers_if_due()

    def _buffers_if_due(self) -> None:
        """DDP broadcasts the module's buffers (BatchNorm's running statistics) from rank 0 at the forward
        that follows a synchronised one (``broadcast_buffers=True``, its default), so that they never drift
        apart for long. A window that ended in a flush had no synchronised forward: the next call's forward
        would broadcast nothing, so the buffers are broadcast here, where DDP would have."""
        if not self.buffers_due:
            return
        self.buffers_due = False
        ddp = self.model
        if not getattr(ddp, "broadcast_buffers", False):
            return
        ignored = getattr(ddp, "parameters_to_ignore", ())
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for name, buffer in ddp.module.named_buffers():
            if name not in ignored:
                by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        with torch.no_grad():
            for buffers in by_kind.values():
                flat = torch.cat([b.reshape(-1) for b in buffers])
                dist.broadcast(flat, source, group=self.group)
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()

    def _got_grad(self, p: torch.Tensor) -> bool:
        cell = self.used.get(id(p))
        return p.grad is not None if cell is None else cell[0]

    def _forget(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.used, self.zeroed = [], {}, set()

    def sync_window(
        self, params: Sequence[torch.Tensor], local_count: LocalCount, pending: int, every: int
    ) -> torch.Tensor | None:
        """Sum the gradients and the item count over the ranks, as DDP's own sync would.

        The ranks first agree on which parameters hold a gradient on some rank (one small all-reduce of a
        flag per parameter, which also carries the item count); a parameter without one anywhere keeps
        ``grad=None``, exactly as DDP leaves a parameter no rank used (so Adam does not move it). The others
        are summed, a missing local gradient counting as zeros: one all-reduce per gradient dtype and device.
        """
        self.boundary_flushes = False  # the window is reduced now
        self.buffers_due = True  # (no synchronised forward ended it: see _buffers_if_due)
        params = _trainable(params)
        device = params[0].device if params else torch.device("cpu")
        got = [self._got_grad(p) for p in params]
        self._forget()
        self.stale = [p for p, had in zip(params, got, strict=True) if had]
        flags = torch.tensor(got, dtype=count_dtype(device))
        count = local_count(device) if local_count is not None else None
        head = flags.to(device) if count is None else torch.cat([flags.to(device), count.reshape(1)])
        dist.all_reduce(head, group=self.group)
        anywhere = head[: len(params)].tolist()  # host sync (once per flush, never on the hot path)
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p, used in zip(params, anywhere, strict=True):
            if not used:
                p.grad = None  # no rank has a gradient for it: left None, as DDP leaves it
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # another rank has one: every rank sends the same layout
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p in group:
                size = p.numel()
                grad = p.grad
                assert grad is not None
                grad.copy_(flat[offset : offset + size].view_as(grad))
                offset += size
        return None if count is None else head[len(params)]

    def after_flush(self, params: Sequence[torch.Tensor]) -> None:
        """Give DDP's still-"used" parameters zero gradients; note which really get one until the update."""
        stale, self.stale = self.stale, []
        if not self.find_unused:
            return
        for p in stale:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                self.zeroed.add(id(p))  # the step's own, not a stray gradient (see Accumulator)
        for p in _trainable(params):
            cell = [False]
            self.used[id(p)] = cell
            self.handles.append(p.register_hook(functools.partial(_note_used, cell)))

    def before_update(self, params: Callable[[], Sequence[torch.Tensor]]) -> None:
        """After a flush: drop (to None) the gradients of parameters no rank used in this window."""
        if not self.used:
            return
        trainable = _trainable(params())
        device = trainable[0].device if trainable else torch.device("cpu")
        flags = torch.tensor([self._got_grad(p) for p in trainable], dtype=count_dtype(device)).to(device)
        self._forget()
        dist.all_reduce(flags, group=self.group)  # the one extra collective, in the window after a flush
        for p, used in zip(trainable, flags.tolist(), strict=True):
            if not used:
                p.grad = None

    def restart(self, pending: int = 0) -> None:
        """Also: a restored window's gradients were put on the parameters, not made by a backward DDP's
        reducer saw, so a synchronised backward would reduce zeros (or nothing) for some of them (a branch one
        rank took before the save): its boundary is reduced as a flush is, from the gradients themselves."""
        self._forget()
        self.stale = []
        self.boundary_flushes = pending > 0


def _trainable(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The distinct ``params`` that require grad, in their order."""
    return list({id(p): p for p in params if p.requires_grad}.values())


def _note_used(cell: list[bool], grad: torch.Tensor) -> None:
    cell[0] = True

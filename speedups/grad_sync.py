"""How the gradients of an accumulation window reach every rank: one process, DDP, or FSDP2.

``@accumulate`` picks one strategy when it decorates (:func:`grad_sync_for`) and calls it on the hot path,
so the accumulator holds no data-parallel branch of its own. A strategy says, per micro-step, which context
the forward and backward run in (:meth:`GradSync.micro_step`), how a micro-step's loss is weighed by its item
count (:meth:`GradSync.reference`, :meth:`GradSync.weigh`), how the item count is all-reduced
(:meth:`GradSync.reduce_count`), and how a flushed short window whose calls never synchronised is reduced
(:meth:`GradSync.sync_window`). DDP and FSDP2 average the gradients over the world size when they sync;
``world`` tells the accumulator by how much.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from speedups import _env
from speedups._wrappers import find_ddp, layers
from speedups.errors import SpeedupsError

__all__ = ["DDPSync", "FSDP2Sync", "GradSync", "SyncKind", "count_dtype", "grad_sync_for"]

_NULL = contextlib.nullcontext()


class SyncKind(enum.Enum):
    """Which gradient synchronisation a step runs under."""

    SINGLE = "single"
    DDP = "ddp"
    FSDP2 = "fsdp2"


def count_dtype(device: torch.device) -> torch.dtype:
    """The dtype item counts are summed in on ``device``: float64, or float32 where there is none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


class GradSync:
    """One process: nothing to synchronise. The base of the data-parallel strategies.

    Attributes:
        kind: the :class:`SyncKind`.
        world: the number of ranks the gradient sync averages over (1 here).
        group: the process group of the item-count all-reduce (None: the default one).
    """

    kind = SyncKind.SINGLE

    def __init__(self, world: int = 1, group: Any = None) -> None:
        self.world = world
        self.group = group

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        """Return the context a micro-step's forward and backward run in (``boundary``: it ends a window)."""
        return _NULL

    def reference(self, n: Any) -> Any:
        """The weight reference of a window whose first item count is ``n`` (a number or a 0-dim tensor).

        One process weighs each backward by ``n / reference``, so that its magnitude (and an fp16 scaler's
        headroom) does not grow with the count; the boundary undoes it exactly.
        """
        if isinstance(n, torch.Tensor):
            return n.detach().reshape(()).to(count_dtype(n.device)).clamp_min(1.0)
        return max(float(n), 1.0)

    def weigh(self, loss: torch.Tensor, n: Any, reference: Any) -> torch.Tensor:
        """The tensor backward runs on for a micro-step of ``n`` items (before loss scaling)."""
        return loss * (n / reference)

    def reduce_count(self, count: torch.Tensor) -> Any:
        """Launch the sum of the window's item ``count`` over the ranks, in place; return the work handle.

        Called at the boundary, before backward, only when ``world > 1``.
        """
        return dist.all_reduce(count, group=self.group, async_op=True)

    def sync_window(
        self,
        optimizer: torch.optim.Optimizer,
        local_count: Callable[[torch.device], torch.Tensor] | None,
        pending: int,
        every: int,
    ) -> torch.Tensor | None:
        """Synchronise a flushed window of ``pending`` calls that never synchronised (every rank calls it).

        Returns the global item count (``local_count(device)`` summed over the ranks), or None when there is
        nothing to sum (no ``local_count``, or one process).
        """
        return None

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Called at a boundary, after the gradients were synchronised and before the optimizer update."""

    def after_flush(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after the update of a flushed window (every rank calls it)."""

    def restart(self) -> None:
        """Forget any switched-off sync, after a checkpoint is loaded: the next window starts afresh."""


class _DataParallel(GradSync):
    """Several ranks: every rank must weigh alike, so a micro-step's weight is its item count itself."""

    def __init__(self, model: Any, world: int, group: Any = None) -> None:
        super().__init__(world, group)
        self.model = model

    def reference(self, n: Any) -> Any:
        return 1.0

    def weigh(self, loss: torch.Tensor, n: Any, reference: Any) -> torch.Tensor:
        return loss * n


class DDPSync(_DataParallel):
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
        self.stale: list[torch.nn.Parameter] = []  # had a gradient in the flushed window, on this rank

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        return _NULL if boundary else self.model.no_sync()

    def _got_grad(self, p: torch.nn.Parameter) -> bool:
        cell = self.used.get(id(p))
        return p.grad is not None if cell is None else cell[0]

    def _forget(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.used = [], {}

    def sync_window(
        self,
        optimizer: torch.optim.Optimizer,
        local_count: Callable[[torch.device], torch.Tensor] | None,
        pending: int,
        every: int,
    ) -> torch.Tensor | None:
        """Sum the gradients and the item count over the ranks, as DDP's own sync would.

        The ranks first agree on which parameters hold a gradient on some rank (one small all-reduce of a
        flag per parameter, which also carries the item count); a parameter without one anywhere keeps
        ``grad=None``, exactly as DDP leaves a parameter no rank used (so Adam does not move it). The others
        are summed, a missing local gradient counting as zeros: one all-reduce per gradient dtype and device.
        """
        params = _params(optimizer)
        device = params[0].device if params else torch.device("cpu")
        got = [self._got_grad(p) for p in params]
        self._forget()
        self.stale = [p for p, had in zip(params, got, strict=True) if had]
        flags = torch.tensor(got, dtype=count_dtype(device))
        count = local_count(device) if local_count is not None else None
        head = flags.to(device) if count is None else torch.cat([flags.to(device), count.reshape(1)])
        dist.all_reduce(head, group=self.group)
        anywhere = head[: len(params)].tolist()  # host sync (once per flush, never on the hot path)
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
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

    def after_flush(self, optimizer: torch.optim.Optimizer) -> None:
        """Give DDP's still-"used" parameters zero gradients; note which really get one until the update."""
        stale, self.stale = self.stale, []
        if not self.find_unused:
            return
        for p in stale:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for p in _params(optimizer):
            cell = [False]
            self.used[id(p)] = cell
            self.handles.append(p.register_hook(functools.partial(_note_used, cell)))

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """After a flush: drop (to None) the gradients of parameters no rank used in this window."""
        if not self.used:
            return
        params = _params(optimizer)
        device = params[0].device if params else torch.device("cpu")
        flags = torch.tensor([self._got_grad(p) for p in params], dtype=count_dtype(device)).to(device)
        self._forget()
        dist.all_reduce(flags, group=self.group)  # the one extra collective, in the window after a flush
        for p, used in zip(params, flags.tolist(), strict=True):
            if not used:
                p.grad = None

    def restart(self) -> None:
        self._forget()
        self.stale = []


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The distinct parameters of ``optimizer`` that require grad, in param-group order."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return list({id(p): p for p in params}.values())


def _note_used(cell: list[bool], grad: torch.Tensor) -> None:
    cell[0] = True


class FSDP2Sync(_DataParallel):
    """An FSDP2 module (``set_requires_gradient_sync``): sync off between boundaries; no flush possible."""

    kind = SyncKind.FSDP2

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, dist.get_world_size() if _env.pg_ready() else 1)
        self.sync_off = False  # gradient sync currently turned off

    def micro_step(self, boundary: bool) -> AbstractContextManager[Any]:
        if self.sync_off == boundary:
            self.model.set_requires_gradient_sync(boundary)
            self.sync_off = not boundary
        return _NULL

    def sync_window(
        self,
        optimizer: torch.optim.Optimizer,
        local_count: Callable[[torch.device], torch.Tensor] | None,
        pending: int,
        every: int,
    ) -> torch.Tensor | None:
        raise SpeedupsError(
            f"accumulate(...).flush(): {pending} micro-steps are pending on an FSDP2 model whose "
            f"gradient sync was off; FSDP2 has no public way to reduce them afterwards. Make the epoch a "
            f"multiple of {every} micro-batches, e.g. DataLoader(..., drop_last=True)."
        )

    def restart(self) -> None:
        self.sync_off = False
        self.model.set_requires_gradient_sync(True)


def grad_sync_for(model: torch.nn.Module | None) -> GradSync:
    """The strategy for ``model`` (as given to ``accumulate(model=...)``), chosen once at decoration.

    DDP and FSDP2 are found through ``torch.compile`` wrappers in either order (``torch.compile(ddp_model)``
    and ``DDP(torch.compile(model))``): see :mod:`speedups._wrappers`.
    """
    if model is None:
        return GradSync()
    ddp = find_ddp(model)
    if ddp is not None:
        return DDPSync(ddp)
    for layer in layers(model):
        if callable(getattr(type(layer), "set_requires_gradient_sync", None)):
            return FSDP2Sync(layer)
    return GradSync()

"""Micro-batches of zero items (all padding) contribute nothing to an accumulation window, NaN-free.

A masked mean over zero items is ``0 / 0``: its loss is NaN and, through the same division, so is every
gradient it reaches, whatever weight (0) the loss is given. The only exact remedy is to keep that micro-step's
gradients out of ``.grad``. With a Python-number count the step knows on the host: one process simply skips
the backward. Where the count is a device tensor (unknown on the host without a sync), or where backward
must run anyway (DDP's reducer expects every rank's backward), :class:`GradMask` drops the micro-step's
gradient in a hook on each parameter, before it is accumulated: ``torch.where(count > 0, grad, 0)``,
NaN-safe, with no host-device sync.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any, Literal

import torch

__all__ = ["GradMask", "Keep", "keep_of"]

Keep = Literal[False] | torch.Tensor | None
"""Which gradients a micro-step keeps: None all, False none, a 0-dim bool tensor where it is True."""


class GradMask:
    """Per-parameter gradient hooks, installed on first need, that drop the current micro-step's gradients.

    ``keep`` is read by the hooks during the backward: None keeps every gradient (the hooks return None: no
    cost beyond a Python call), False drops them all, a 0-dim bool tensor keeps them where it is True.
    """

    def __init__(self) -> None:
        self.keep: bool | torch.Tensor | None = None
        self.installed = False

    def install(self, params: Iterable[torch.Tensor]) -> None:
        """Hook every distinct parameter that requires grad; the hooks go when this object is collected."""
        if self.installed:
            return
        hook = functools.partial(_mask, weakref.ref(self))
        seen: set[int] = set()
        handles = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                handles.append(p.register_hook(hook))
        weakref.finalize(self, _remove, handles).atexit = False
        self.installed = True

    def backward(
        self,
        target: torch.Tensor,
        keep: bool | torch.Tensor | None,
        params: Iterable[torch.Tensor],
        *,
        single: bool,
    ) -> None:
        """Run ``target.backward()``, keeping the gradients as ``keep`` says (see :func:`keep_of`).

        One process skips the backward of a host-known zero count; elsewhere the hooks drop the gradients.
        """
        if keep is False and single:
            return  # zero items on the host, one process: nothing to learn, no backward to run
        if keep is not None:
            self.install(params)
        self.keep = keep
        try:
            target.backward()
        finally:
            self.keep = None


def keep_of(n: Any) -> Literal[False] | torch.Tensor | None:
    """Which gradients a micro-step of ``n`` items keeps: None (all), False (none), or ``n > 0`` on device."""
    if isinstance(n, torch.Tensor):
        return n.detach().reshape(()) > 0  # a device bool: no sync
    return None if n else False


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _mask(owner: weakref.ref[GradMask], grad: torch.Tensor) -> torch.Tensor | None:
    mask = owner()
    keep = None if mask is None else mask.keep
    if keep is None:
        return None
    if keep is False:
        return torch.zeros_like(grad)
    assert isinstance(keep, torch.Tensor)
    if keep.device != grad.device:  # a parameter on another device (a shard_model part on the CPU)
        # to a GPU: asynchronous, ordered on its stream; to the CPU: it must wait for the value (a
        # non-blocking copy to the host would be read before it landed)
        keep = keep.to(grad.device, non_blocking=grad.device.type != "cpu")
    return torch.where(keep, grad, 0)

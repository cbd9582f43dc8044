"""Which gradient-sync strategy a step runs under, decided once from the ``model=`` it was given."""

from __future__ import annotations

import torch

from speedups._helpers.wrappers import find_ddp, layers
from speedups.accumulation.grad_sync.base import GradSync
from speedups.accumulation.grad_sync.ddp import DDPSync
from speedups.accumulation.grad_sync.fsdp2 import FSDP2Sync

__all__ = ["grad_sync_for"]


def grad_sync_for(model: torch.nn.Module | None) -> GradSync:
    """The strategy for ``model`` (as given to ``accumulate(model=...)``), chosen once at decoration.

    DDP and FSDP2 are found through ``torch.compile`` wrappers in either order (``torch.compile(ddp_model)``
    and ``DDP(torch.compile(model))``): see :mod:`speedups._helpers.wrappers`.
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

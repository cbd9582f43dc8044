"""The models, optimizers and data the tests share: each test builds its own, from fixed seeds.

A wrapper is checked against a plain-PyTorch reference: :func:`twin` gives a model and an identical copy,
each with its own optimizer, and :func:`reference_step` is the hand-written optimizer step of the copy.
"""

from __future__ import annotations

import copy
import itertools
from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn


def linear_data(n: int = 40, *, inputs: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of regression data: ``x`` of shape ``(n, inputs)``, ``y`` of shape ``(n, 1)``, float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, inputs, generator=g), torch.randn(n, 1, generator=g)


def mlp(*sizes: int, activation: type[nn.Module] = nn.Tanh, seed: int = 0) -> nn.Sequential:
    """``mlp(3, 8, 1)``: Linear(3, 8), activation, Linear(8, 1), initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers += [nn.Linear(a, b)] if i == 0 else [activation(), nn.Linear(a, b)]
    return nn.Sequential(*layers)


class FakeFSDP2(nn.Linear):
    """``nn.Linear(3, 1)`` standing in for an FSDP2 module: all ``@accumulate`` looks for is
    ``set_requires_gradient_sync``, whose calls it records in ``sync_calls``."""

    def __init__(self) -> None:
        super().__init__(3, 1)
        self.sync_calls: list[bool] = []

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        self.sync_calls.append(requires_gradient_sync)


class Twin(NamedTuple):
    """A model and its optimizer, and an identical copy (the reference) with its own."""

    model: nn.Module
    opt: torch.optim.Optimizer
    ref: nn.Module
    ref_opt: torch.optim.Optimizer


def twin(model: nn.Module | None = None, *, seed: int = 0, lr: float = 0.1) -> Twin:
    """``model`` (default: ``nn.Linear(3, 1)`` from ``seed``) and a deep copy, each with ``SGD(lr)``."""
    if model is None:
        torch.manual_seed(seed)
        model = nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    return Twin(model, opt, ref, ref_opt)


def reference_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """The hand-written optimizer step: ``zero_grad()``, ``loss.backward()``, ``step()``."""
    opt.zero_grad()
    loss.backward()
    opt.step()


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, as ``clip_grad_norm_`` computes it (``get_total_norm`` from
    torch 2.6; the same norm of per-tensor norms before)."""
    get = getattr(torch.nn.utils, "get_total_norm", None)
    if get is not None:
        return get(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class DropBlock(nn.Module):
    """A residual block with dropout: ``x + drop(fc2(gelu(fc1(norm(x))))) * scale``, ``x`` ``(rows, width)``.

    ``norm="batch"`` uses BatchNorm1d (running statistics written by each training forward)."""

    def __init__(self, width: int = 16, *, norm: str = "layer", p: float = 0.3) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))) * scale


class Blocks(nn.Module):
    """``blocks`` (a ModuleList of :class:`DropBlock`) between an input and an output Linear: ``(rows, 3) ->
    (rows, 1)``. ``hand=True`` calls each block through ``torch.utils.checkpoint`` (non-reentrant) in forward:
    the hand-written reference of activation checkpointing."""

    def __init__(
        self, depth: int = 3, width: int = 16, *, norm: str = "layer", hand: bool = False, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(3, width)
        self.blocks = nn.ModuleList(DropBlock(width, norm=norm) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        self.hand = hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.hand:
                h = torch.utils.checkpoint.checkpoint(block, h, scale=0.5, use_reentrant=False)
            else:
                h = block(h, scale=0.5)
        return self.out(h)

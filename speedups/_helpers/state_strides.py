"""Optimizer state and gradients laid out as their parameters are, in place, values exact.

A fused optimizer step (``Adam(fused=True)``, ``AdamW(fused=True)``, ``SGD(fused=True)``) walks a parameter,
its gradient and its state tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) element by element
in memory order: a state tensor or gradient laid out otherwise than its parameter pairs the wrong elements,
silently (pytorch/pytorch#126585). The foreach and for-loop steps index logically and are exact either way.
Used where a layout can part from its parameter's: ``fast_kernels`` changing weights' memory format, and
``load_checkpoint`` (``Optimizer.load_state_dict`` keeps the strides the state was saved with).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["follow_strides", "state_follows_params"]


def follow_strides(tensor: object, param: torch.Tensor) -> bool:
    """Give ``tensor`` (a gradient or a state value) ``param``'s strides in place, if it is a dense tensor of
    ``param``'s shape with other strides and ``param`` is dense itself (no overlap, no gap); its values,
    dtype and device stay (``.data`` is set: the same tensor object). Returns whether it changed.

    Tensor subclasses (a sharded ``DTensor``) are left as they are, on either side.
    """
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return False
    if type(param.data) is not torch.Tensor or param.layout != torch.strided:  # a DTensor Parameter
        return False
    if tensor.shape != param.shape or tensor.stride() == param.stride() or not _dense(param):
        return False
    moved = torch.empty_strided(tensor.shape, param.stride(), dtype=tensor.dtype, device=tensor.device)
    moved.copy_(tensor)
    tensor.data = moved
    return True


def state_follows_params(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None, *, grads: bool = False
) -> int:
    """Give every state tensor of ``optimizer`` that has its parameter's shape that parameter's strides (and,
    with ``grads``, each parameter's gradient too), in place, values exact.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its state is keyed by its parameters.
        params: the parameters whose state to lay out (None: all of ``optimizer``'s).
        grads: also lay out each parameter's ``.grad``.

    Returns:
        How many state tensors were laid out anew (gradients not counted).
    """
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    moved = 0
    with torch.no_grad():
        for param in params:
            if grads and param.grad is not None:
                follow_strides(param.grad, param)
            state = optimizer.state.get(param)  # a defaultdict: .get adds no entry
            if isinstance(state, dict):
                moved += sum(follow_strides(value, param) for value in state.values())
    return moved


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a block of memory without overlap or gap (any order of dimensions)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True

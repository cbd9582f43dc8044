"""Change weights' memory layout in place, with their gradients and the optimizer state made for them.

A fused optimizer step (``Adam(fused=True)``, ``AdamW(fused=True)``, ``SGD(fused=True)``) walks a parameter,
its gradient and its state tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...) element by element
in memory order: a state tensor laid out otherwise than its parameter pairs the wrong elements, silently
(pytorch/pytorch#126585; seen: Adam 0.046 off after ``fast_kernels(model).restore()``). The foreach and
for-loop steps index logically and are exact either way. So a weight's layout change is made to its gradient
and to every per-parameter state tensor of its shape too, in place: the same ``Parameter`` and state tensor
objects (optimizers key their state by the ``Parameter`` and list it in ``param_groups``; ``.data`` is set as
``nn.Module.to`` does by default, whatever ``torch.__future__`` says), values exact (a layout change moves
elements, it computes nothing): :mod:`speedups._helpers.state_strides`, which ``load_checkpoint`` uses too.

The switch that changes the layout is not given the optimizers: they are found by one scan of the live
objects (``gc``), every ``torch.optim.Optimizer`` that holds one of the weights, at each change.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from speedups._helpers.state_strides import follow_strides, state_follows_params

__all__ = ["holding_optimizers", "relayout"]


def relayout(weights: Sequence[torch.Tensor], memory_format: torch.memory_format) -> int:
    """Give each of ``weights`` (4-d ``Parameter``s) ``memory_format`` in place, and its gradient and the
    state tensors of its shape in every optimizer that holds it the weight's new strides.

    Returns:
        How many optimizer state tensors were laid out anew.
    """
    with torch.no_grad():
        for weight in weights:
            if not weight.is_contiguous(memory_format=memory_format):
                weight.data = weight.contiguous(memory_format=memory_format)
            if weight.grad is not None:
                follow_strides(weight.grad, weight)
    return sum(state_follows_params(optimizer, weights) for optimizer in holding_optimizers(weights))


def holding_optimizers(tensors: Sequence[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """Every live ``torch.optim.Optimizer`` with one of ``tensors`` in its ``param_groups`` (one scan of the
    objects ``gc`` tracks: about 35 ms per million objects on a CPU core)."""
    wanted = {id(t) for t in tensors}
    optimizer = torch.optim.Optimizer
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), optimizer):  # type(), not isinstance: a proxy's __class__ is not asked
            groups = getattr(obj, "param_groups", None) or []
            if any(id(p) in wanted for group in groups for p in group.get("params", ())):
                found.append(obj)
    return found

"""What a decorated step may return and what the call hands back: a loss, ``(loss, num_items)``, a mapping.

A mapping ``{"loss": loss, "num_items": n, **extras}`` lets a step hand out more than its loss (the logits
for accuracy, an RNN's hidden state) without globals. The call returns the same mapping type with the loss
detached, ``num_items`` as given (detached) and every extra passed through, its tensors detached. With
micro-batching, tensor extras are concatenated along dim 0 in micro-batch order; other extras come from the
last micro-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from speedups._helpers.tree import tree_map

__all__ = ["as_loss_and_items", "merge_extras", "result_of"]

_LOSS, _ITEMS = "loss", "num_items"


def as_loss_and_items(out: Any) -> Any:
    """``out`` in the older forms: a mapping becomes ``loss`` or ``(loss, num_items)``; others pass through.

    Raises:
        TypeError: a mapping without a ``"loss"`` key.
    """
    if not isinstance(out, Mapping):
        return out
    if _LOSS not in out:
        keys = sorted(map(repr, out))[:8]
        raise TypeError(
            f"accumulate: the step returned a {type(out).__name__} with keys [{', '.join(keys)}] but no "
            f"'loss': a mapping must hold the scalar loss under 'loss' (and may hold 'num_items' and any "
            f"extras). Return {{'loss': loss, 'num_items': len(y), 'logits': logits}}."
        )
    loss = out[_LOSS]
    return (loss, out[_ITEMS]) if out.get(_ITEMS) is not None else loss


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def result_of(out: Any, loss: torch.Tensor, n: Any) -> Any:
    """What the call returns for the step's ``out``, given the detached whole-call ``loss`` and ``n``."""
    if isinstance(out, Mapping):
        extras = {k: v for k, v in out.items() if k not in (_LOSS, _ITEMS)}
        values = {_LOSS: loss, **({_ITEMS: _detach(n)} if _ITEMS in out else {}), **tree_map(_detach, extras)}
        if isinstance(out, MutableMapping):
            new = copy.copy(out)  # keeps the mapping type and key order
            for k, v in values.items():
                new[k] = v
            return new
        return type(out)(values)  # type: ignore[call-arg]
    if n is None:
        return loss
    return loss, _detach(n)


def merge_extras(outs: Sequence[Any]) -> Any:
    """The step output of a micro-batched call: the last output, its tensor extras the concatenation of all.

    ``outs`` are the micro-batches' outputs in order (mappings, or all of another form: then the last one).
    A tensor extra is concatenated along dim 0 when every micro-batch returned a tensor with >= 1 dim there.
    """
    last = outs[-1]
    if len(outs) == 1 or not isinstance(last, Mapping):
        return last
    merged = copy.copy(last) if isinstance(last, MutableMapping) else dict(last)
    for key, value in last.items():
        if key in (_LOSS, _ITEMS) or not isinstance(value, torch.Tensor):
            continue
        pieces = [o.get(key) if isinstance(o, Mapping) else None for o in outs]
        if all(isinstance(p, torch.Tensor) and p.dim() >= 1 for p in pieces):
            merged[key] = torch.cat([p.detach() for p in pieces if p is not None])
    return merged

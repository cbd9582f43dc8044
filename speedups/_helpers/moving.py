"""Moving one leaf of a nested batch to a device: what :func:`~speedups.to_device` and ``shard_model``'s
hooks apply to every tensor, module and object with a ``.to`` method."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from speedups._helpers import env
from speedups.errors import SpeedupsWarning

__all__ = ["DeviceLike", "LeafMover", "moves_itself"]

DeviceLike = torch.device | str | int
"""What a ``device=`` argument takes: a ``torch.device``, a name (``"cuda:1"``) or a CUDA index."""


def moves_itself(obj: Any) -> bool:
    """Whether ``obj`` is a leaf for the walk: a tensor, a module, or an object whose class has ``.to``.

    The last case includes containers that know how to move themselves and must not be taken apart, such
    as ``PackedSequence`` (a namedtuple whose ``batch_sizes`` must stay on the CPU).
    """
    return isinstance(obj, (torch.Tensor, torch.nn.Module)) or (
        not isinstance(obj, type) and callable(getattr(type(obj), "to", None))
    )


class LeafMover:
    """The function :func:`to_device` applies to each leaf, for an already resolved ``target``.

    Built once and reused by callers on a hot path (``shard_model``'s hooks), so a call costs no device
    lookup: tensors move with ``Tensor.to`` (no copy when already there; ``non_blocking`` as documented in
    :func:`to_device`), modules with ``nn.Module.to``, objects with a ``.to`` method with it. A plain
    class rather than a closure, so that a module holding one in a hook can still be pickled.
    """

    __slots__ = ("non_blocking", "target")

    def __init__(self, target: torch.device, non_blocking: bool | None = None) -> None:
        self.target = target
        self.non_blocking = non_blocking

    def __call__(self, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            nb = self.non_blocking
            if nb is None:
                nb = self.target.type == "cuda" and leaf.device.type == "cpu" and leaf.is_pinned()
            return leaf.to(self.target, non_blocking=nb)
        if isinstance(leaf, torch.nn.Module):
            return leaf.to(self.target)
        if isinstance(leaf, (str, bytes, type)):
            return leaf
        to = getattr(leaf, "to", None)
        if callable(to):
            return to(self.target)
        if not isinstance(leaf, _PLAIN_LEAVES):
            _warn_if_it_holds_tensors(leaf, self.target)
        return leaf


_PLAIN_LEAVES = (int, float, complex, bool, type(None), range, slice)
_warned_types: set[type] = set()  # classes already named in a warning (one warning per class)


def _warn_if_it_holds_tensors(leaf: Any, target: torch.device) -> None:
    """Warn once per class when an object we cannot walk or move holds tensors in its attributes."""
    cls = type(leaf)
    if cls in _warned_types:
        return
    try:
        attributes = dict(vars(leaf))
    except TypeError:  # no __dict__: look at __slots__
        names = [n for c in cls.__mro__ for n in getattr(c, "__slots__", ()) if isinstance(n, str)]
        attributes = {n: getattr(leaf, n, None) for n in names}
    holding = [name for name, value in attributes.items() if isinstance(value, torch.Tensor)]
    if not holding:
        return
    _warned_types.add(cls)
    if env.rank() == 0:
        warnings.warn(
            f"to_device(<{cls.__qualname__}>, {str(target)!r}): a {cls.__qualname__} holds tensors "
            f"({', '.join(holding[:4])}) but is not a container to_device walks (dict, list, tuple, "
            f"namedtuple, deque, set, dataclass) and has no .to() method, so its tensors were left where "
            f"they are. Make the class a @dataclasses.dataclass, or give it "
            f"`def to(self, device): return {cls.__name__}(...moved fields...)`.",
            SpeedupsWarning,
            stacklevel=4,
        )

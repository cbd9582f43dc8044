"""One rule for the wrappers around a user's model: DDP, ``nn.DataParallel`` and ``torch.compile``.

Users wrap in either order (``torch.compile(DDP(model))``, the order PyTorch recommends, or
``DDP(torch.compile(model))``), and sometimes both ways at once. Every piece of ``speedups`` that needs the
DDP object (for ``no_sync``), the plain module (for sharding, checks) or plain checkpoint keys asks here.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from speedups._helpers import compat

__all__ = ["PREFIXES", "find_ddp", "layers", "live_wrapper_of", "strip_prefixes", "unwrap"]

# The key prefixes wrappers add to a state_dict: DDP and DataParallel's ``module.``, compile's ``_orig_mod.``.
PREFIXES = ("module.", "_orig_mod.")


def layers(model: nn.Module) -> Iterator[nn.Module]:
    """Yield ``model`` and each module it wraps, outermost first, down to the plain module."""
    current: nn.Module | None = model
    while current is not None:
        yield current
        if isinstance(current, (DistributedDataParallel, DataParallel)):
            current = current.module
        else:
            current = compat.compiled_inner(current)


def unwrap(model: nn.Module) -> nn.Module:
    """Return the plain module inside any nesting of DDP, DataParallel and ``torch.compile`` wrappers."""
    for layer in layers(model):
        inner = layer
    return inner


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """Return the ``DistributedDataParallel`` layer of ``model`` in any wrapper order, or None."""
    for layer in layers(model):
        if isinstance(layer, DistributedDataParallel):
            return layer
    return None


def live_wrapper_of(
    ids: set[int], kinds: tuple[type[nn.Module], ...] = (DistributedDataParallel, DataParallel)
) -> nn.Module | None:
    """A live wrapper of one of ``kinds`` around a parameter whose ``id`` is in ``ids``, or None: for a
    check made once, off the hot path (one scan of the objects ``gc`` tracks).
    """
    with warnings.catch_warnings():  # isinstance on some of torch's objects warns of deprecations
        warnings.simplefilter("ignore")
        # type(), not isinstance: a weakref.proxy answers __class__ from its referent, or raises once it died
        found = [o for o in gc.get_objects() if issubclass(type(o), kinds)]
    return next((w for w in found if any(id(p) in ids for p in w.parameters())), None)


def strip_prefixes(state_dict: Mapping[str, Any], expected: Iterable[str] | None = None) -> dict[str, Any]:
    """Remove the wrapper prefixes (:data:`PREFIXES`, any nesting) that every key of ``state_dict`` carries.

    With ``expected`` (the keys of the plain module it will load into), a prefix is removed only while the
    keys do not already match those, so a plain model whose one child is named ``module`` keeps its keys.
    Save from :func:`unwrap` instead where the model is at hand; this is for files written by others.
    """
    keys = dict(state_dict)
    wanted = None if expected is None else set(expected)
    while keys and (wanted is None or set(keys) != wanted):
        prefix = next((p for p in PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        keys = {k[len(prefix) :]: v for k, v in keys.items()}
    return keys

"""Map a function over the leaves of nested containers, keeping every container's exact type.

Containers: any ``Mapping`` (dict, OrderedDict, defaultdict with its ``default_factory``, UserDict and other
subclasses, extra attributes included), list, tuple, namedtuple (and their subclasses), ``deque`` (its
``maxlen`` kept), set, frozenset, and dataclass instances (frozen ones and ``field(init=False)`` too).
Everything else is a leaf. The input is never
modified: each container is rebuilt, and a container none of whose leaves changed is still a new object.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

__all__ = ["tree_leaves", "tree_map"]


def tree_map(fn: Callable[[Any], Any], obj: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Return ``obj`` with every leaf ``x`` replaced by ``fn(x)``; containers keep their exact type.

    ``is_leaf(x)`` True makes ``x`` a leaf even if it is a container (e.g. an object that moves itself).

    Raises:
        TypeError: a read-only mapping type that cannot be rebuilt from a dict.
    """
    if isinstance(obj, (str, bytes)) or (is_leaf is not None and is_leaf(obj)):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _map_mapping(fn, obj, is_leaf)
    if isinstance(obj, tuple):
        items = [tree_map(fn, v, is_leaf) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, list):
        new_list = copy.copy(obj)  # keeps a subclass and its attributes
        new_list[:] = [tree_map(fn, v, is_leaf) for v in obj]
        return new_list
    if isinstance(obj, deque):
        new_deque = copy.copy(obj)  # keeps maxlen, a subclass and its attributes
        new_deque.clear()
        new_deque.extend(tree_map(fn, v, is_leaf) for v in obj)
        return new_deque
    if isinstance(obj, (set, frozenset)):
        return type(obj)(tree_map(fn, v, is_leaf) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)  # no __init__ / __post_init__ rerun; init=False values carried over
        for f in dataclasses.fields(obj):
            # object.__setattr__ writes frozen dataclasses too, on the copy only.
            object.__setattr__(new, f.name, tree_map(fn, getattr(obj, f.name), is_leaf))
        return new
    return fn(obj)


def tree_leaves(obj: Any) -> Iterator[Any]:
    """Yield the leaves of ``obj`` that :func:`tree_map` (without ``is_leaf``) would map, in its order.

    Walks the same containers, without rebuilding any, so it costs no allocation beyond the walk.
    """
    if isinstance(obj, (str, bytes)):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tree_leaves(value)
    elif isinstance(obj, (tuple, list, deque, set, frozenset)):
        for value in obj:
            yield from tree_leaves(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tree_leaves(getattr(obj, f.name))
    else:
        yield obj


def _map_mapping(
    fn: Callable[[Any], Any], obj: Mapping[Any, Any], is_leaf: Callable[[Any], bool] | None
) -> Any:
    mapped = {k: tree_map(fn, v, is_leaf) for k, v in obj.items()}
    if isinstance(obj, MutableMapping):
        # copy.copy keeps the type, defaultdict's factory, OrderedDict's order and instance attributes.
        new = copy.copy(obj)
        for k, v in mapped.items():
            new[k] = v
        return new
    try:
        return type(obj)(mapped)  # type: ignore[call-arg]
    except TypeError as err:
        raise TypeError(
            f"cannot rebuild a read-only mapping of type {type(obj).__qualname__} from a dict ({err}). "
            f"Pass a dict, or give {type(obj).__qualname__} a constructor that takes one."
        ) from err

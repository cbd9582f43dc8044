"""A cheap, bounded record of the state a loader's workers copy: what changed is told apart, nothing is held.

A fresh ``DataLoader`` worker copies the dataset (and ``collate_fn``, ``worker_init_fn``) as the main process
holds them when the epoch starts; a persistent worker keeps the copy it made once. :class:`Fingerprint`
records that state so a change shows, on either side: in the main process (``dataset.labels[:] = new``,
``dataset.epoch = 3``) and in a worker (``worker_init_fn`` or ``__getitem__`` changing the worker's copy,
a generator the dataset owns advancing).
"""

from __future__ import annotations

import functools
import itertools
import random
import sys
import types
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from speedups._helpers import compat

__all__ = ["MAIN", "WORKER", "Fingerprint", "Limits"]


class Limits(NamedTuple):
    """How far a :class:`Fingerprint` looks; beyond these it samples, or stops."""

    nodes: int
    """Values recorded at most (each attribute, element or object is one); the walk stops there."""
    depth: int
    """Levels of plain objects walked below a root (a dataset, wrapped ones included, costs no level)."""
    items: int
    """Elements of a list, tuple, dict or set read whole; a longer one is read at this many places."""
    nbytes: int
    """Bytes of a numpy array hashed whole; a larger one is hashed at up to 8,192 elements."""
    inside: int
    """Elements of one container walked into (a record's fields, a tensor's version) beyond the hash of
    them all: the first this many that are not scalars."""


MAIN = Limits(nodes=4000, depth=3, items=100_000, nbytes=4 << 20, inside=4000)
"""The main process's, once per epoch (about a millisecond for 100,000 labels)."""
WORKER = Limits(nodes=1000, depth=3, items=2048, nbytes=64 << 10, inside=32)
"""A worker's, after each batch it loads (a few microseconds for a tensor dataset)."""

_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_SEQUENCES = (list, tuple, deque)
_SETS = (set, frozenset)
_CODE = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.ModuleType,
    type,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
)
_NONE = (type(None), None)


class Fingerprint:
    """The state reachable from ``roots`` (``{"dataset": ds, "collate_fn": fn}``), as ``{path: token}``.

    Each root is walked: a scalar by value; a tensor by identity, version counter (bumped by every in-place
    change; not for a CPU tensor in shared memory, whose changes reach every worker), data pointer and
    shape; a numpy array by identity, pointer, shape, dtype and a hash of its bytes; a ``torch.Generator``
    (CPU), ``numpy.random.Generator``, ``RandomState``, bit generator or ``random.Random`` by its state; a
    list, tuple, dict or set by identity, length and a hash of its elements (then its elements); a
    ``functools.partial`` and a bound method by what they hold; any other object by identity and type,
    then its attributes (``__dict__`` and ``__slots__``). Datasets (``Dataset`` instances:
    ``Subset.dataset``, ``ConcatDataset.datasets``) are walked at any depth, other objects
    ``limits.depth`` levels down. An object met twice is recorded once. What lies past the limits (a
    list's unsampled elements, a large array's unsampled bytes, objects below the depth, values past the
    node budget) is not seen: :attr:`cut` says whether something was left.

    Attributes are read from ``__dict__`` (no property runs). A walk never raises: what cannot be read is
    recorded by identity.
    """

    __slots__ = ("_budget", "_limits", "_seen", "cut", "tokens")

    def __init__(self, roots: dict[str, Any], limits: Limits = MAIN) -> None:
        self.tokens: dict[str, Any] = {}
        self.cut = False
        self._limits, self._budget = limits, limits.nodes
        self._seen: dict[int, str] = {}
        for name, value in roots.items():
            self._visit(name, value, limits.depth)
        del self._seen  # ids only: nothing of the walk is held

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.tokens == other.tokens

    __hash__ = None  # type: ignore[assignment]

    def changed(self, before: Fingerprint) -> list[str]:
        """The paths (``"dataset.labels"``) whose value differs from ``before``'s, added or gone, sorted."""
        if self.tokens == before.tokens:
            return []
        mine, theirs = self.tokens, before.tokens
        return sorted(p for p in mine.keys() | theirs.keys() if mine.get(p, _GONE) != theirs.get(p, _GONE))

    def opened_lazily(self, before: Fingerprint, paths: Iterable[str]) -> bool:
        """Whether every path of ``paths`` lies under an attribute that held None in ``before`` (or did not
        exist) and now holds an object of no watched kind: a file or database handle opened at the first
        item, the usual way of h5py and LMDB datasets, which a fresh worker would open again to the same
        effect. A tensor, array, container or generator set so is not one."""
        opened = [
            p for p, t in self.tokens.items() if t[0] == "object" and before.tokens.get(p, _NONE) == _NONE
        ]
        return bool(opened) and all(
            any(p == o or p.startswith((o + ".", o + "[")) for o in opened) for p in paths
        )

    # ------------------------------------------------------------------------------------------- the walk
    def _visit(self, path: str, value: Any, depth: int) -> None:
        if self._budget <= 0:
            self.cut = True
            return
        self._budget -= 1
        kind = type(value)
        if kind in _SCALARS:
            self.tokens[path] = (kind, value)
            return
        key = id(value)
        if key in self._seen:  # the same object again (shared, or a cycle)
            self.tokens[path] = ("same", self._seen[key])
            return
        self._seen[key] = path
        try:
            self._record(path, value, kind, key, depth)
        except Exception:  # a value that cannot be read: told apart by identity
            self.tokens[path] = ("unread", kind, key)

    def _record(self, path: str, value: Any, kind: type, key: int, depth: int) -> None:
        category = _CATEGORIES.get(kind) or _category(kind)
        if category == "tensor":  # in shared memory, a change reaches every worker: no version counter
            shared = value.device.type == "cpu" and _shared(value)
            version = None if shared else compat.grad_version(value)
            self.tokens[path] = ("tensor", key, version, _pointer(value), value.shape)
        elif category == "sequence":
            self._container(path, value, kind, key, depth, value)
        elif category == "dict":
            self._container(path, value, kind, key, depth, value.values(), keys=value.keys())
        elif category == "code":
            self.tokens[path] = ("code", key)
        elif category == "array":
            self.tokens[path] = ("array", key, *self._array(value, sys.modules["numpy"]))
        elif category == "torch rng":
            state = value.get_state() if value.device.type == "cpu" else None  # CUDA: not in a fork
            self.tokens[path] = ("rng", key, None if state is None else hash(state.numpy().tobytes()))
        elif category == "random":
            self.tokens[path] = ("rng", key, hash(value.getstate()))
        elif category == "numpy rng":
            bits = getattr(value, "bit_generator", value)  # a Generator's, or a bit generator itself
            self.tokens[path] = ("rng", key, _frozen(bits.state, sys.modules["numpy"]))
        elif category == "random state":
            self.tokens[path] = ("rng", key, _frozen(value.get_state(legacy=False), sys.modules["numpy"]))
        elif category == "set":  # by value, in no order (a set's order depends on its history)
            whole = len(value) <= self._limits.items
            self.tokens[path] = ("set", kind, key, len(value), hash(frozenset(value)) if whole else None)
            self.cut = self.cut or not whole
        elif category == "partial":
            self.tokens[path] = ("partial", key)
            self._visit(path + ".func", value.func, depth)
            self._visit(path + ".args", value.args, depth)
            self._visit(path + ".keywords", value.keywords, depth)
        elif category == "method":
            self.tokens[path] = ("method", key, id(value.__func__))
            self._visit(path + ".__self__", value.__self__, depth)
        else:
            self.tokens[path] = ("object", kind, key)
            dataset = category == "dataset"
            if depth > 0 or dataset:
                for name, attribute in _attributes(value):
                    self._visit(path + "." + name, attribute, depth if dataset else depth - 1)
            elif _attributes(value):
                self.cut = True

    def _container(
        self, path: str, value: Any, kind: type, key: int, depth: int, elements: Any, keys: Any = None
    ) -> None:
        n, most = len(value), self._limits.items
        step = 1 if n <= most else -(-n // most)
        self.cut = self.cut or step > 1
        if isinstance(elements, (list, tuple)):
            sampled = elements[::step]
        else:
            sampled = list(itertools.islice(elements, 0, None, step))
        named = None if keys is None else list(itertools.islice(keys, 0, None, step))
        self.tokens[path] = ("items", kind, key, n, _hash(sampled), None if named is None else _hash(named))
        if set(map(type, sampled)) <= _SCALARS:  # values alone, all hashed above (at C speed)
            return
        inside = self._limits.inside
        for i, element in enumerate(sampled):
            if self._budget <= 0 or inside <= 0:
                self.cut = True
                return
            if type(element) not in _SCALARS:
                inside -= 1
                self._visit(path + _label(i * step, None if named is None else named[i]), element, depth)

    def _array(self, value: Any, np: Any) -> tuple[Any, ...]:
        pointer = value.__array_interface__["data"][0]
        if value.dtype.hasobject:
            flat = value.reshape(-1) if value.size <= self._limits.items else value.flat[: self._limits.items]
            return pointer, value.shape, value.dtype.str, _hash(list(flat))
        if value.nbytes <= self._limits.nbytes:
            data = value.tobytes()
        else:
            self.cut = True
            places = np.linspace(0, value.size - 1, min(self._limits.items, 8192)).astype(np.intp)
            data = value.flat[places].tobytes()
        return pointer, value.shape, value.dtype.str, hash(data)


_GONE = ("gone",)
_CATEGORIES: dict[type, str] = {}
"""What each type met is recorded as (:func:`_category`), worked out once per type."""


def _category(kind: type) -> str:
    """How a value of type ``kind`` is recorded (see :class:`Fingerprint`)."""
    np = sys.modules.get("numpy")  # no numpy object can exist before numpy is imported
    checks: list[tuple[str, Any]] = [
        ("tensor", torch.Tensor),
        ("sequence", _SEQUENCES),
        ("dict", dict),
        ("code", _CODE),
        ("torch rng", torch.Generator),
        ("random", random.Random),
        ("set", _SETS),
        ("partial", functools.partial),
        ("method", types.MethodType),
        ("dataset", Dataset),
    ]
    if np is not None:
        checks[1:1] = [
            ("array", np.ndarray),
            ("numpy rng", (np.random.Generator, np.random.BitGenerator)),
            ("random state", np.random.RandomState),
        ]
    category = _CATEGORIES[kind] = next((name for name, of in checks if issubclass(kind, of)), "object")
    return category


def _shared(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.untyped_storage().is_shared())
    except Exception:  # no storage (sparse, nested, a subclass without data)
        return False


def _label(place: int, key: Any) -> str:
    """``[3]`` or ``['train']`` for an element's path (a dict key of another kind: its place, ``[#3]``)."""
    if key is None:
        return f"[{place}]"
    return f"[{key!r}]" if type(key) in (int, str) else f"[#{place}]"


def _pointer(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.data_ptr())
    except Exception:  # no storage (meta, sparse, a subclass without data)
        return 0


def _hash(values: Any) -> int:
    """A hash of the values (by value where hashable, else by identity)."""
    values = tuple(values)
    try:
        return hash(values)
    except Exception:  # an unhashable element (a list, an array): their identities
        return hash(tuple(map(id, values)))


def _frozen(state: Any, np: Any) -> Any:
    """A generator's state (dicts, tuples, numpy arrays, ints) as a hashable value."""
    if isinstance(state, dict):
        return tuple((k, _frozen(v, np)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_frozen(v, np) for v in state)
    if isinstance(state, np.ndarray):
        return hash(state.tobytes())
    return state


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """An object's own attributes: its ``__dict__``, then its ``__slots__`` that are set."""
    own = getattr(value, "__dict__", None)
    out = list(own.items()) if isinstance(own, dict) else []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                try:
                    out.append((name, object.__getattribute__(value, name)))
                except AttributeError:
                    continue
    return out

"""What persistent workers cannot see: a dataset attribute reassigned in the main process after they started.

Each worker holds the copy of the dataset made when it started; ``dataset.epoch = 3`` (or ``.train = False``,
``.transform = ...``) in the main process later changes only the main process's copy, where fresh workers
would have copied it again. :func:`attribute_ids` records a dataset's attributes (and those of the datasets
it wraps through ``.dataset``) when workers start; :func:`reassigned` names those reassigned since. A change
inside an attribute (a list appended to) is not seen.
"""

from __future__ import annotations

from typing import Any

__all__ = ["attribute_ids", "reassigned"]

_SCALARS = (int, float, complex, str, bytes, bool, type(None))

Snapshot = dict[tuple[int, str], tuple[int, Any]]
"""``{(depth, name): (id(value), (type, value) of a scalar, else None)}``: values are not held, only told
apart."""


def attribute_ids(dataset: Any, depth: int = 4) -> Snapshot:
    """The attributes of ``dataset`` and of the datasets it wraps through ``.dataset``, up to ``depth``."""
    out: Snapshot = {}
    for level in range(depth):
        state = getattr(dataset, "__dict__", None)
        if not isinstance(state, dict):
            break
        for name, value in state.items():
            out[(level, name)] = (id(value), (type(value), value) if type(value) in _SCALARS else None)
        inner = state.get("dataset")
        if inner is None or inner is dataset:
            break
        dataset = inner
    return out


def reassigned(before: Snapshot, dataset: Any) -> list[str]:
    """The attributes of ``dataset`` (``"dataset.epoch"``, ``"dataset.dataset.train"``) reassigned, added or
    deleted since ``before`` (an equal scalar assigned again counts as unchanged)."""
    now = attribute_ids(dataset)
    names = []
    for key in before.keys() | now.keys():
        old, new = before.get(key), now.get(key)
        if (
            old is not None
            and new is not None
            and (old[0] == new[0] or (old[1] is not None and old[1] == new[1]))
        ):
            continue  # the same object, or an equal scalar of the same type
        depth, name = key
        names.append("dataset" + ".dataset" * depth + "." + name)
    return sorted(names)

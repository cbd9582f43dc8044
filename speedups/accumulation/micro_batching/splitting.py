"""Splitting one call's arguments into micro-batches: along dim 0 (:func:`split_call`), or by the user's
``split=`` (:func:`custom_split`, checked to cover the batch in order)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from speedups._helpers.tree import tree_map
from speedups._helpers.validate import short

__all__ = ["Piece", "Split", "custom_split", "split_call"]

Piece = tuple[int | None, tuple[Any, ...], dict[str, Any]]  # (rows, args, kwargs) of one micro-batch
Split = Callable[[tuple[Any, ...], dict[str, Any], int], Any]


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, obj)
    return found


def _count_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The rows of a call: dim 0 of its first tensor with a dim, else ``len()`` of its first argument."""
    for t in _tensors((args, kwargs)):
        if t.dim() >= 1:
            return int(t.shape[0])
    first = args[0] if args else next(iter(kwargs.values()), None)
    if first is not None and not isinstance(first, (str, bytes)) and hasattr(first, "__len__"):
        return len(first)
    return None


def split_call(args: tuple[Any, ...], kwargs: dict[str, Any], size: int) -> tuple[int, list[Piece]]:
    """Split a call's arguments into micro-batches of at most ``size`` rows: ``(rows, pieces)``.

    Every tensor with a dim 0, at any depth of the positional and keyword arguments, must have the batch's
    rows there and is sliced along it (views, no copy); everything else is passed whole to every micro-batch.

    Raises:
        ValueError: no tensor with a dim 0, or tensors whose dim 0 differ.
    """
    leaves = (*args, *kwargs.values())
    flat = all(isinstance(x, torch.Tensor) or not _is_container(x) for x in leaves)  # no tree walks
    batched = [t for t in (leaves if flat else _tensors((args, kwargs))) if _batched(t)]
    if not batched:
        raise ValueError(
            "accumulate(..., micro_batch_size=...): the call has no tensor with a batch dimension to split "
            "(tensors are found in tuples, lists, dicts and dataclasses, at any depth). Pass the batch as "
            "tensors, or give split=lambda args, kwargs, size: [(args_i, kwargs_i), ...]."
        )
    rows = int(batched[0].shape[0])
    odd = sorted({tuple(t.shape) for t in batched if t.shape[0] != rows})
    if odd:
        raise ValueError(
            f"accumulate(..., micro_batch_size=...): the batch has {rows} rows (dim 0 of its first tensor, "
            f"shape {tuple(batched[0].shape)}) but tensors of shapes {odd[:4]} have another dim 0; every "
            f"tensor argument is split along dim 0. Pass tensors that are not per-row through a closure "
            f"(functools.partial), or give split= your own rule."
        )
    if rows <= size:
        return rows, [(rows, args, kwargs)]
    chunks = {id(t): t.split(size) for t in batched}  # views, one call per tensor
    counts = [min(size, rows - start) for start in range(0, rows, size)]
    if flat:
        return rows, [
            (
                count,
                tuple(chunks[id(a)][i] if _batched(a) else a for a in args),
                {k: chunks[id(v)][i] if _batched(v) else v for k, v in kwargs.items()},
            )
            for i, count in enumerate(counts)
        ]
    pieces: list[Piece] = []
    for i, count in enumerate(counts):

        def cut(x: Any, i: int = i) -> Any:
            return chunks[id(x)][i] if _batched(x) else x

        pieces.append((count, tree_map(cut, args), tree_map(cut, kwargs)))
    return rows, pieces


def _batched(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 1


def _is_container(x: Any) -> bool:
    return isinstance(x, (Mapping, list, tuple)) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def custom_split(
    split: Split, args: tuple[Any, ...], kwargs: dict[str, Any], size: int
) -> tuple[int | None, list[Piece]]:
    """Run the user's ``split=`` and check that its pieces cover the batch in order, each within ``size``."""
    rows = _count_rows(args, kwargs)
    if rows is not None and rows <= size:
        return rows, [(rows, args, kwargs)]
    raw = split(args, kwargs, size)
    if not isinstance(raw, Iterable) or isinstance(raw, (str, bytes, Mapping, torch.Tensor)):
        raise TypeError(
            f"accumulate(..., split=...): split(args, kwargs, {size}) returned {short(raw)}: expected a list "
            f"of (args, kwargs) pairs, one per micro-batch. Return e.g. [((x[i:i + size],), {{}}) for i in "
            f"range(0, len(x), size)]."
        )
    pieces: list[Piece] = []
    for piece in raw:
        if not (isinstance(piece, tuple) and len(piece) == 2 and isinstance(piece[0], tuple)
                and isinstance(piece[1], Mapping)):  # fmt: skip
            raise TypeError(
                f"accumulate(..., split=...): split(args, kwargs, {size}) yielded {short(piece)}: expected "
                f"(args, kwargs) pairs, a tuple and a dict per micro-batch."
            )
        pieces.append((_count_rows(piece[0], dict(piece[1])), piece[0], dict(piece[1])))
    counts = [r for r, _, _ in pieces]
    bad = not pieces or (
        rows is not None
        and (any(r is None or not 1 <= r <= size for r in counts) or sum(r or 0 for r in counts) != rows)
    )
    if bad:
        raise ValueError(
            f"accumulate(..., split=...): split(args, kwargs, {size}) returned micro-batches of "
            f"{counts} rows for a batch of {rows} rows: they must cover the batch exactly, each with 1 to "
            f"{size} rows. Return every row once, in order, e.g. [(args[:, i:i + size], kwargs) ...]."
        )
    return rows, pieces

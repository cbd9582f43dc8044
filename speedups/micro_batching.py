"""Micro-batches that fit, found while training: each call's batch split along dim 0, exactly the big batch.

``@accumulate(n, optimizer, micro_batch_size=...)`` hands every call to a :class:`MicroBatcher`. It splits
the call's arguments into micro-batches of at most ``micro_batch_size`` rows (:func:`split_call`, or the
user's ``split=``), runs forward and backward once per micro-batch, weighted so that the gradients equal one
backward of the whole batch's loss (by rows for a bare mean loss, by the returned ``num_items`` otherwise),
and returns the whole batch's detached loss. With ``"auto"`` it starts with the whole batch; on out of memory
(forward or backward, :func:`speedups._oom.is_out_of_memory`) it puts the gradients back as they were when
the call began, frees memory, halves the size and runs the call again. The size found is kept.

Data parallel (DDP): every micro-backward runs inside ``no_sync()`` and the boundary call all-reduces the
gradients once, after its last micro-batch (one flat all-reduce per dtype, like a flushed window). A rank
that runs out of memory retries alone, before any collective: its peers wait in the all-reduce for the
length of the retry, never in a mismatched collective, and no agreement collective is needed.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Protocol

import torch

from speedups import _step
from speedups._oom import is_out_of_memory
from speedups._step_checks import check_outer_autocast, short
from speedups._step_output import merge_extras, result_of
from speedups._tree import tree_map
from speedups.errors import SpeedupsError
from speedups.grad_sync import GradSync, SyncKind

__all__ = ["AUTO", "MicroBatcher", "make_micro_batcher", "split_call"]

AUTO = "auto"
Piece = tuple[int | None, tuple[Any, ...], dict[str, Any]]  # (rows, args, kwargs) of one micro-batch
Split = Callable[[tuple[Any, ...], dict[str, Any], int], Any]


Keep = Literal[False] | torch.Tensor | None  # which gradients a micro-batch keeps (speedups._zero_items)


class _Step(Protocol):
    """What the micro-batcher uses of ``@accumulate``'s accumulator (see speedups.accumulation)."""

    every: int
    pending: int
    step: int
    is_boundary: bool
    inv_every: float
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    sync: GradSync
    ref_n: Any
    total_host: float
    total_device: torch.Tensor | None
    check_losses: bool
    losses: list[torch.Tensor]

    def adopt_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler: ...
    def _parse(self, out: Any) -> tuple[torch.Tensor, Any]: ...
    def _weigh_items(self, loss: torch.Tensor, n: Any, *, first: bool) -> tuple[torch.Tensor, Keep]: ...
    def _backward(self, target: torch.Tensor, keep: Keep, weight: float = ...) -> None: ...
    def _update(self, synced: bool) -> None: ...
    def flush(self) -> None: ...
    def _reset_window(self) -> None: ...


def make_micro_batcher(micro_batch_size: Any, split: Any, kind: SyncKind, every: int) -> MicroBatcher | None:
    """Check ``micro_batch_size=`` and ``split=`` of ``accumulate(every, ...)``; None when not splitting.

    Raises:
        TypeError: ``micro_batch_size`` neither None, an int nor ``"auto"``; ``split`` not callable.
        ValueError: ``micro_batch_size < 1``, another string, or ``split=`` without ``micro_batch_size=``.
        SpeedupsError: an FSDP2 model (micro-batching is DDP and single-process only for now).
    """
    call = f"accumulate({every}, optimizer, micro_batch_size={short(micro_batch_size)}, ...)"
    fix = 'Write micro_batch_size=8 (rows per micro-batch) or micro_batch_size="auto".'
    if micro_batch_size is None:
        if split is not None:
            raise ValueError(
                f"accumulate({every}, optimizer, split={short(split)}): split= only applies with "
                f"micro_batch_size=. {fix}"
            )
        return None
    if isinstance(micro_batch_size, str):
        if micro_batch_size != AUTO:
            raise ValueError(f"{call}: the only string allowed is 'auto'. {fix}")
    elif isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(
            f"{call}: expected an int >= 1, 'auto' or None, got {type(micro_batch_size).__name__}. {fix}"
        )
    elif micro_batch_size < 1:
        raise ValueError(f"{call}: must be >= 1 (rows per micro-batch). {fix}")
    if split is not None and not callable(split):
        raise TypeError(
            f"{call}: split={short(split)} is not callable. Pass a function "
            f"split(args, kwargs, micro_batch_size) -> [(args, kwargs), ...], or leave split=None."
        )
    if kind is SyncKind.FSDP2:
        raise SpeedupsError(
            f"{call}: micro-batching does not support FSDP2 models yet (its gradients cannot be reduced "
            f"after unsynchronised backwards). Use micro_batch_size=None and accumulate more calls instead."
        )
    return MicroBatcher(micro_batch_size, split)


# ------------------------------------------------------------------------------------------- splitting
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


def _custom_split(
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


# ------------------------------------------------------------------------------------ gradient restore
def _set_aside(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Take the gradients off the parameters (no copy): the call's backwards start from None."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    return saved


def _put_back(params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
    """Drop whatever a failed try accumulated and restore the gradients of the call's start."""
    for p, g in zip(params, saved, strict=True):
        p.grad = g


def _add_back(params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
    """The call succeeded: its gradients plus the ones set aside (in place, no new memory)."""
    for p, g in zip(params, saved, strict=True):
        if g is not None:
            if p.grad is not None:
                g.add_(p.grad)
            p.grad = g


def _drop_window(acc: _Step, err: Exception, backwards: int) -> None:
    """A call failed after some of its micro-batches' backwards: close the window, as a failed update does.

    Their gradients are already summed into ``.grad`` and cannot be taken out (only ``"auto"`` sets the
    gradients aside), so the window's gradients are dropped and its counters reset: the next call starts a
    fresh window instead of stepping on a part of a call.
    """
    dropped = acc.pending + 1
    acc.optimizer.zero_grad(set_to_none=True)
    acc._reset_window()
    err.add_note(  # type: ignore[attr-defined]
        f"speedups.accumulate: this call failed after {backwards} of its micro-batches had run "
        f"backward, so the open accumulation window ({dropped} call(s)) was dropped: gradients set to None, "
        f"train_step.pending is 0. Nothing was stepped."
    )


def _release_memory() -> None:
    gc.collect()  # the failed try's graph may sit in reference cycles
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------- calls
class MicroBatcher:
    """Runs one call of a decorated step as micro-batches; ``size`` is the rows per micro-batch (None: all).

    Attributes:
        auto: whether the size is found on out of memory.
        size: the current rows per micro-batch; None while ``auto`` has not needed to split.
    """

    def __init__(self, micro_batch_size: int | str, split: Split | None) -> None:
        self.auto = micro_batch_size == AUTO
        self.size: int | None = None if self.auto else int(micro_batch_size)
        self.split = split
        self.backwards = 0  # micro-batch backwards run by the current call

    def pieces(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, list[Piece]]:
        """The call's rows and micro-batches at the current size, checked before anything runs."""
        size = sys.maxsize if self.size is None else self.size
        if self.split is None:
            return split_call(args, kwargs, size)
        return _custom_split(self.split, args, kwargs, size)

    def __call__(self, acc: _Step, wrapped: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        """One call of the step: every micro-batch's forward and backward, then the update at a boundary."""
        rows, pieces = self.pieces(args, kwargs)  # bad input raises here, before any backward
        boundary = acc.pending + 1 >= acc.every
        acc.is_boundary = boundary
        ddp = acc.sync.kind is SyncKind.DDP
        params = [p for g in acc.optimizer.param_groups for p in g["params"]] if self.auto else []
        window = (acc.total_host, acc.total_device, acc.ref_n)  # undone when a try fails
        token = _step.current_step.set(acc)
        try:
            while True:
                saved = _set_aside(params) if self.auto else None
                try:
                    with acc.sync.micro_step(False):  # DDP: no_sync(); the boundary reduces once below
                        loss, n, out = self._run(acc, wrapped, rows, pieces)
                    break
                except Exception as err:
                    acc.total_host, acc.total_device, acc.ref_n = window
                    if saved is None:
                        if self.backwards:  # gradients of part of this call are in .grad: none can be trusted
                            _drop_window(acc, err, self.backwards)
                        raise
                    _put_back(params, saved)
                    largest = max((r or 0) for r, _, _ in pieces)
                    if not is_out_of_memory(err) or largest <= 1:
                        raise
                # Out of memory: outside the except block, so the traceback (and the graph) can be freed.
                del saved
                _release_memory()
                self.size = (largest + 1) // 2
                rows, pieces = self.pieces(args, kwargs)
            if saved is not None:
                _add_back(params, saved)
        finally:
            _step.current_step.reset(token)
        if acc.check_losses:
            acc.losses.append(loss)
        acc.step += 1
        acc.pending += 1
        if boundary:
            if ddp:
                acc.flush()  # one all-reduce of the summed gradients (per dtype) and of the item count
            else:
                acc._update(synced=True)
        return result_of(out, loss, n)

    def _run(
        self, acc: _Step, wrapped: Callable[..., Any], rows: int | None, pieces: list[Piece]
    ) -> tuple[torch.Tensor, Any, Any]:
        """Forward and backward of every micro-batch: the whole call's detached loss, count and output."""
        single = len(pieces) == 1
        total: torch.Tensor | None = None
        count: Any = 0
        outs: list[Any] = []
        n: Any = None
        self.backwards = 0
        for i, (piece_rows, piece_args, piece_kwargs) in enumerate(pieces):
            keep: Keep = None  # None: every gradient of this micro-batch counts
            out = wrapped(*piece_args, **piece_kwargs)
            loss, n = acc._parse(out)
            detached = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
            if n is None:  # a mean loss: the whole batch's mean weighs each micro-batch by its rows
                if single:
                    weight = 1.0
                elif piece_rows is None or not rows:
                    raise ValueError(
                        "accumulate(..., split=...): the micro-batches' rows cannot be counted (no tensor "
                        "with a dim 0), so a bare mean loss cannot be weighed. Return (loss, num_items)."
                    )
                else:
                    weight = piece_rows / rows
                target, scale = loss, weight * acc.inv_every
                if single:
                    total = detached
                elif total is None:
                    total = detached * weight
                else:
                    total.add_(detached, alpha=weight)  # in place: one small op per micro-batch
            else:
                # A zero-item micro-batch adds nothing (its mean loss is NaN): keep says what counts.
                target, keep = acc._weigh_items(loss, n, first=acc.pending == 0 and i == 0)
                scale = 1.0
                part = detached if single else detached * n
                if not single and keep is not None:
                    part = torch.where(keep, part, 0.0) if keep is not False else torch.zeros_like(part)
                total = part if total is None else total + part
                count = count + (n.detach() if isinstance(n, torch.Tensor) else n)
            if acc.scaler is None:
                check_outer_autocast(loss.device.type)
            acc._backward(target, keep, scale)
            self.backwards += 1
            # Keep only detached extras: a kept output would hold its graph's tensors until the call ends.
            outs.append(tree_map(_detached, out) if isinstance(out, Mapping) else None)
        assert total is not None
        if n is not None and not single:
            if isinstance(count, torch.Tensor):
                total = torch.where(count > 0, total / count, total)
            elif count:
                total = total / count
            n = count
        elif n is not None:
            n = count
        return total, n, merge_extras(outs)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value

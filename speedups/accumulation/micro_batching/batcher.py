"""Micro-batches that fit, found while training: each call's batch split along dim 0, exactly the big batch.

``@accumulate(n, optimizer, micro_batch_size=...)`` hands every call to a :class:`MicroBatcher`. It splits
the call's arguments into micro-batches of at most ``micro_batch_size`` rows (:func:`~.splitting.split_call`,
or the user's ``split=``), runs forward and backward once per micro-batch, weighted so that the gradients
equal one backward of the whole batch's loss (by rows for a bare mean loss, by the returned ``num_items``
otherwise), and returns the whole batch's detached loss. With ``"auto"`` it starts with the whole batch; on
out of memory (forward or backward, :func:`speedups._helpers.oom.is_out_of_memory`) it puts the gradients
back as they were when the call began, and the buffers and RNG streams the failed try changed
(:mod:`.retry_state`), frees memory, halves the size and runs the call again: the hand loop's call at the
size found. The size found is kept.

The batcher is a strategy of the accumulator: it reaches the step only through the small
:class:`MicroBatchHost` interface (parse a result, weigh and run one backward, save and restore the
window's item counts, drop the window), so the accumulator alone owns its state.

Data parallel (DDP): every micro-backward runs inside ``no_sync()`` and the boundary call all-reduces the
gradients once, after its last micro-batch (one flat all-reduce per dtype, like a flushed window). A rank
that runs out of memory retries alone, before any collective: its peers wait in the all-reduce for the
length of the retry, never in a mismatched collective, and no agreement collective is needed. FSDP2: the
micro-batches run with gradient sync off but the last of a boundary call; its forward gathers parameters
with collectives, so ``"auto"`` cannot retry one rank alone (the error says so).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from speedups._helpers.notes import add_note
from speedups._helpers.oom import is_out_of_memory
from speedups._helpers.tree import tree_map
from speedups._helpers.validate import integer_or_auto, short
from speedups.accumulation.micro_batching.memory_plan import MemoryPlan
from speedups.accumulation.micro_batching.retry_state import RetryState
from speedups.accumulation.micro_batching.splitting import Piece, Split, custom_split, split_call
from speedups.accumulation.output import merge_extras
from speedups.accumulation.zero_items import Keep

__all__ = ["AUTO", "MicroBatchHost", "MicroBatcher", "check_micro_batching"]

AUTO = "auto"


class MicroBatchHost(Protocol):
    """What the micro-batcher uses of the step it serves (``@accumulate``'s accumulator)."""

    def parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        """Check one micro-batch's result; return ``(loss, num_items)`` (``num_items`` None: a mean loss)."""
        ...

    def backward_micro(self, loss: torch.Tensor, n: Any, weight: float, *, first_piece: bool) -> Keep:
        """Weigh and run one micro-batch's backward (``weight``: its share of the rows, for a mean loss);
        return which of its gradients count."""
        ...

    def piece_context(self, last: bool) -> AbstractContextManager[Any]:
        """The context one micro-batch runs in (``last``: the call's last; DDP: ``no_sync()`` for all)."""
        ...

    def retry_allowed(self, backwards: int) -> bool:
        """Whether the call may run again at a smaller size after ``backwards`` micro-batch backwards."""
        ...

    def trainable(self) -> list[torch.Tensor]:
        """The parameters whose gradients a failed try must restore."""
        ...

    def window_counts(self) -> Any:
        """A snapshot of the open window's item counts, for :meth:`restore_counts`."""
        ...

    def restore_counts(self, snapshot: Any) -> None:
        """Put the window's item counts back as :meth:`window_counts` saw them."""
        ...

    def drop_window(self) -> int:
        """Close the window without an update (gradients to None); return the calls it held with this one."""
        ...


def check_micro_batching(micro_batch_size: Any, split: Any, every: int) -> None:
    """Check ``micro_batch_size=`` and ``split=`` of ``accumulate(every, ...)`` (None: no micro-batching).

    Raises:
        TypeError: ``micro_batch_size`` neither None, an int nor ``"auto"``; ``split`` not callable.
        ValueError: ``micro_batch_size < 1``, another string, or ``split=`` without ``micro_batch_size=``.
    """
    call = f"accumulate({every}, optimizer, micro_batch_size={short(micro_batch_size)}, ...)"
    fix = 'Write micro_batch_size=8 (rows per micro-batch) or micro_batch_size="auto".'
    if micro_batch_size is None:
        if split is not None:
            raise ValueError(
                f"accumulate({every}, optimizer, split={short(split)}): split= only applies with "
                f"micro_batch_size=. {fix}"
            )
        return
    expected = "an int >= 1, 'auto' or None"
    integer_or_auto(micro_batch_size, call, expected=expected, unit="rows per micro-batch", fix=fix)
    if split is not None and not callable(split):
        raise TypeError(
            f"{call}: split={short(split)} is not callable. Pass a function "
            f"split(args, kwargs, micro_batch_size) -> [(args, kwargs), ...], or leave split=None."
        )


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

    def __init__(
        self,
        micro_batch_size: int | str,
        split: Split | None,
        plan: MemoryPlan | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.auto = micro_batch_size == AUTO
        # what a try changes besides gradients (buffers, RNG streams), put back before a retry
        self.retry = RetryState(model) if self.auto else None
        self.size: int | None = None if self.auto else int(micro_batch_size)
        self.split = split
        self.backwards = 0  # micro-batch backwards the current call started
        self.plan = plan  # with memory_budget=: chooses the size and the checkpointed blocks
        self._planning = plan is not None  # until the plan's choice is taken

    def plan_state(self) -> dict[str, Any] | None:
        """The memory plan's choice, to save with the step (None: no plan, or it still measures)."""
        return None if self.plan is None else self.plan.state_dict()

    def check_plan(self, state: Any) -> None:
        """Raise ``ValueError`` if a saved plan (:meth:`plan_state`; None: none saved) does not fit here."""
        if state is not None and self.plan is not None:
            self.plan.check_state(state)

    def take_plan(self, state: dict[str, Any] | None) -> None:
        """Resume with the plan a run saved (:meth:`plan_state`): its size and blocks, no trials; a plan made
        for another budget is not taken (this step plans anew)."""
        if state is not None and self.plan is not None and self.plan.load_state_dict(state):
            self.size = self.plan.size_for(None)
            self._planning = False

    def _split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], size: int
    ) -> tuple[int | None, list[Piece]]:
        if self.split is None:
            return split_call(args, kwargs, size)
        return custom_split(self.split, args, kwargs, size)

    def pieces(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, list[Piece]]:
        """The call's rows and micro-batches at the current size, checked before anything runs."""
        if self._planning and self.plan is not None:
            self.size = self.plan.size_for(self._split(args, kwargs, sys.maxsize)[0])
            self._planning = not self.plan.done
        return self._split(args, kwargs, sys.maxsize if self.size is None else self.size)

    def run(
        self,
        host: MicroBatchHost,
        wrapped: Callable[..., Any],
        args: Any,
        kwargs: dict[str, Any],
        split: tuple[int | None, list[Piece]],
    ) -> tuple[torch.Tensor, Any, Any]:
        """Every micro-batch's forward and backward of one call: ``(detached loss, num_items, output)``.

        ``split`` is what :meth:`pieces` returned for the call (checked before the step changed anything).

        The loss is the whole batch's (the rows' mean for a mean loss, the items' mean otherwise) and the
        output the last micro-batch's, its tensor extras concatenated (see ``speedups.accumulation.output``).
        A failed call leaves the window's item counts as they were; under ``"auto"``, out of memory retries
        at half the size, the gradients put back first; a failure after some backwards that cannot be undone
        closes the window (a note on the error says so).
        """
        plan = self.plan if self.plan is not None and not self.plan.done else None
        if plan is None:
            return self._run_sizes(host, wrapped, args, kwargs, split)
        plan.begin()
        failed = True
        try:
            result = self._run_sizes(host, wrapped, args, kwargs, split)
            failed = False
        finally:
            plan.end(split[0], self.size, failed)
        if plan.choice is not None:  # chosen at this call's end: the next call runs at its size
            self.size, self._planning = plan.choice.micro_batch_size, False
        return result

    def _run_sizes(
        self,
        host: MicroBatchHost,
        wrapped: Callable[..., Any],
        args: Any,
        kwargs: dict[str, Any],
        split: tuple[int | None, list[Piece]],
    ) -> tuple[torch.Tensor, Any, Any]:
        """:meth:`run` without the plan's measurements: the call, at half the size again on out of memory."""
        rows, pieces = split
        params = host.trainable() if self.auto else []
        window = host.window_counts()  # undone when a try fails
        retry, halved = self.retry, False
        while True:
            saved = _set_aside(params) if self.auto else None
            state = retry.take() if retry is not None else None
            try:
                result = self._run(host, wrapped, rows, pieces)
                break
            except BaseException as err:  # a Ctrl-C too: the window is left whole or dropped, never half
                host.restore_counts(window)
                if retry is not None:
                    retry.pause()
                if saved is not None and is_out_of_memory(err) and not host.retry_allowed(self.backwards):
                    _put_back(params, saved)  # what can be put back; the rest is FSDP2's
                    saved = None
                    add_note(
                        err,
                        "speedups.accumulate: micro_batch_size='auto' cannot retry this call: with FSDP2 the "
                        "other ranks go on with their collectives, and gradients of a backward run with sync "
                        "off sit in FSDP2's own buffers. Give a fixed micro_batch_size that fits.",
                    )
                if saved is None:
                    if self.backwards:  # gradients of part of this call are in .grad: none can be trusted
                        dropped = host.drop_window()
                        add_note(
                            err,
                            f"speedups.accumulate: this call failed after {self.backwards} of its "
                            f"micro-batches had started backward, so the open accumulation window ({dropped} "
                            f"call(s)) was dropped: gradients set to None, train_step.pending is 0. Nothing "
                            f"was stepped.",
                        )
                    raise
                _put_back(params, saved)  # the window as the call found it: the call did not happen
                largest = max((r or 0) for r, _, _ in pieces)
                if not is_out_of_memory(err) or largest <= 1:
                    if halved:  # the error of the smaller size, not of the call as written: say so
                        add_note(
                            err,
                            f"speedups.accumulate: raised by the call run again at micro_batch_size="
                            f"{self.size} after running out of memory with larger micro-batches (\"auto\"); "
                            f"the window is as the call found it.",
                        )
                    raise
            # Out of memory: outside the except block, so the traceback (and the graph) can be freed.
            del saved
            _release_memory()
            if retry is not None and state is not None:
                retry.put_back(state)  # the retry starts from the buffers and RNG streams the try found
            self.size, halved = (largest + 1) // 2, True
            rows, pieces = self.pieces(args, kwargs)
        if saved is not None:
            _add_back(params, saved)
        if retry is not None:
            retry.done()
        return result

    def _run(
        self, host: MicroBatchHost, wrapped: Callable[..., Any], rows: int | None, pieces: list[Piece]
    ) -> tuple[torch.Tensor, Any, Any]:
        """Forward and backward of every micro-batch: the whole call's detached loss, count and output."""
        single = len(pieces) == 1
        total: torch.Tensor | None = None
        count: Any = 0
        outs: list[Any] = []
        n: Any = None
        self.backwards = 0
        for i, (piece_rows, piece_args, piece_kwargs) in enumerate(pieces):
            with host.piece_context(last=i + 1 == len(pieces)):  # forward and backward inside
                out = wrapped(*piece_args, **piece_kwargs)
                loss, n = host.parse(out)
                detached = loss.detach() if loss.dim() == 0 else loss.detach().reshape(())
                if n is None:  # a mean loss: the whole batch's mean weighs each micro-batch by its rows
                    if single:
                        weight = 1.0
                    elif piece_rows is None or not rows:
                        raise ValueError(
                            "accumulate(..., split=...): the micro-batches' rows cannot be counted (no "
                            "tensor with a dim 0), so a bare mean loss cannot be weighed. Return (loss, "
                            "num_items)."
                        )
                    else:
                        weight = piece_rows / rows
                    self.backwards += 1  # (counted as it starts: one that fails half-way left gradients)
                    host.backward_micro(loss, None, weight, first_piece=i == 0)
                    if single:
                        total = detached
                    elif total is None:
                        total = detached * weight
                    else:
                        total.add_(detached, alpha=weight)  # in place: one small op per micro-batch
                else:
                    # A zero-item micro-batch adds nothing (its mean loss is NaN): keep says what counts.
                    self.backwards += 1
                    keep = host.backward_micro(loss, n, 1.0, first_piece=i == 0)
                    part = detached if single else detached * n
                    if not single and keep is not None:
                        part = torch.where(keep, part, 0.0) if keep is not False else torch.zeros_like(part)
                    total = part if total is None else total + part
                    count = count + (n.detach() if isinstance(n, torch.Tensor) else n)
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

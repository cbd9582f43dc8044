"""The plan that mixes the two memory levers: micro-batch size and checkpointed blocks, chosen by measurement.

``@accumulate(..., micro_batch_size="auto", memory_budget=..., model=model)`` gives the micro-batcher a
:class:`MemoryPlan`. Smaller micro-batches keep fewer activations at once but run the device on less work per
kernel; checkpointing a block (:func:`speedups.checkpoint_activations`) frees its activations for about one
more forward of it. Which mix is fastest depends on the model, so the plan measures it on the first calls of
training, every one of them a real training call (the gradients are those of the big batch, as always):

1. **Probe** (one call): the whole batch (or the given ``micro_batch_size``), nothing checkpointed, with the
   bytes kept for backward counted per block (:class:`~speedups.memory.saved_activations.SavedActivations`).
2. **Candidates**: for each micro-batch size (halving, as ``"auto"`` does), the fewest blocks to checkpoint,
   most memory freed per second of recompute first, for the predicted bytes to fit the budget (bytes grow
   with the rows). Sizes below the largest that fits with nothing checkpointed are never faster: not tried.
3. **Trials** (three calls per candidate when there are several): the first counts the bytes (a candidate
   over the budget is out, and one block more, or half the size, is tried instead), the next
   :data:`TIMED_CALLS` are timed (the fastest, in seconds per row; on a GPU each synchronises, once).
4. **Choice**: the fastest candidate that fits; its micro-batch size and checkpointed blocks stay for the
   run (:attr:`MemoryPlan.choice`, saved with the step's state so a resumed run keeps them). Ranks of a
   multi-process job agree (one all-reduce after the probe, one after the trials): each runs the same plan.

The budget is in bytes: on the CPU it holds the activations counted (exact, device-independent); on a GPU
the peak memory the call adds, measured (``"auto"``: the free memory when the plan starts).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speedups._helpers import env
from speedups._helpers.validate import integer_or_auto
from speedups._helpers.wrappers import unwrap
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.memory import checkpoint_activations, checkpointed_modules, uncheckpoint_activations
from speedups.memory.blocks import overlaps, pick_modules
from speedups.memory.saved_activations import SavedActivations

__all__ = ["MemoryPlan", "PlanChoice", "budget_bytes", "check_memory_budget"]


def check_memory_budget(budget: Any, model: Any, every: int) -> None:
    """Check ``memory_budget=`` of ``accumulate(every, ...)`` (None: no plan).

    Raises:
        TypeError: ``budget`` neither None, an int nor ``"auto"``; ``model`` not a module.
        ValueError: ``budget < 1``, another string, or no ``model=`` to plan the checkpointing of.
    """
    if budget is None:
        return
    call = f"accumulate({every}, optimizer, memory_budget={budget!r}, ...)"
    fix = 'Write memory_budget=8 * 2**30 (bytes) or memory_budget="auto", with model=model.'
    integer_or_auto(budget, call, expected="an int of bytes >= 1 or 'auto'", unit="bytes", fix=fix)
    if model is None:
        raise ValueError(
            f"{call}: the plan checkpoints blocks of the model, so it needs model=. Write "
            f"accumulate({every}, optimizer, memory_budget={budget!r}, model=model)."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model= must be an nn.Module, got {type(model).__name__}.")


TIMED_CALLS = 2
"""Timed calls per candidate, after its counted one: the fastest is its time (a shared machine's noise)."""


@dataclass(frozen=True)
class PlanChoice:
    """What a :class:`MemoryPlan` chose (or tried): a micro-batch size and the blocks it checkpoints.

    ``bytes``: the bytes measured for it (counted activations on the CPU, added peak memory on a GPU);
    ``seconds_per_row``: its timed call's seconds per row (None: not timed, the only candidate).
    """

    micro_batch_size: int
    checkpointed: tuple[str, ...]
    bytes: int | None = None
    seconds_per_row: float | None = None

    def __str__(self) -> str:
        blocks = ", ".join(self.checkpointed) if self.checkpointed else "no block"
        measured = "" if self.bytes is None else f", {_size(self.bytes)}"
        timed = "" if self.seconds_per_row is None else f", {self.seconds_per_row * 1e3:.3f} ms/row"
        return f"micro_batch_size={self.micro_batch_size}, checkpointing {blocks}{measured}{timed}"


def budget_bytes(budget: int | str, device: torch.device) -> int | None:
    """The budget in bytes: ``budget`` itself, or for ``"auto"`` the free memory of ``device`` (a GPU's
    ``torch.cuda.mem_get_info``, the CPU's available pages); None where it cannot be read."""
    if isinstance(budget, int):
        return budget
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not Linux
        return None


@dataclass
class _Probe:
    rows: int  # rows of the micro-batch the bytes were counted on
    per_row: float  # bytes held at peak, per row of a micro-batch
    savings: list[tuple[str, float, float]] = field(default_factory=list)  # (block, bytes/row, seconds/row)


class MemoryPlan:
    """Chooses the micro-batch size and checkpointed blocks of an ``@accumulate`` step (module docstring).

    Attributes:
        choice: the plan chosen, or None while it measures.
        tried: every candidate measured, with its bytes and time.
    """

    def __init__(self, budget: int | str, model: nn.Module, fixed_size: int | None, world: int) -> None:
        self.budget_spec = budget
        self.model = model
        self.fixed_size = fixed_size
        self.world = world
        self.choice: PlanChoice | None = None
        self.tried: list[PlanChoice] = []
        self._budget: int | None = None
        self._probe: _Probe | None = None
        self._queue: list[PlanChoice] = []  # candidates still to try (a counted call, then timed ones)
        self._current: PlanChoice | None = None
        self._calls_on_current = 0
        self._counter: SavedActivations | None = None
        self._started = 0.0
        self._base = 0
        self._device = _device_of(model)
        self._own: tuple[str, ...] = ()  # the blocks this plan checkpointed (the user's stay untouched)
        self._error: SpeedupsError | None = None  # found after a call: raised before the next one

    @property
    def done(self) -> bool:
        return self.choice is not None

    # ------------------------------------------------------------------------------ around each call
    def size_for(self, rows: int | None) -> int | None:
        """Before a call of ``rows`` rows: the micro-batch size to run it at (checkpointing set for it)."""
        if self._error is not None:
            raise self._error
        if self.choice is not None:
            return self.choice.micro_batch_size
        if rows is None:
            raise SpeedupsError(
                "accumulate(..., memory_budget=...): the rows of this call's batch cannot be counted (no "
                "tensor with a dim 0), so no micro-batch size can be planned. Give micro_batch_size=<int> "
                "and checkpoint blocks yourself with checkpoint_activations(model, names)."
            )
        if self._budget is None:
            self._budget = budget_bytes(self.budget_spec, self._device)
        if self._probe is None:
            self._apply(())
            size = self.fixed_size or rows
            self._current = PlanChoice(size or 1, ())
        elif self._current is None:
            self._current = self._queue.pop(0)
            self._calls_on_current = 0
            self._apply(self._current.checkpointed)
        assert self._current is not None
        return self._current.micro_batch_size

    def begin(self) -> None:
        """The call starts (after :meth:`size_for`): count its bytes or start its clock."""
        if self.choice is not None:
            return
        if self._probe is None or self._calls_on_current == 0:
            self._counter = SavedActivations(self.model).__enter__()
            if self._device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self._device)
                self._base = torch.cuda.memory_allocated(self._device)
        else:
            _synchronize(self._device)
            self._started = time.perf_counter()

    def end(self, rows: int | None, size: int | None, failed: bool) -> None:
        """The call of ``rows`` rows ended, run at micro-batch ``size`` (``failed``: it raised): record what
        it measured and move the plan on. Never raises: an error found here is raised before the next call."""
        if self.choice is not None:
            return
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
        if failed or self._current is None:
            return  # the call is tried again at the next one
        rows = rows or 1
        if self._probe is None:
            assert counter is not None
            self._probe = self._measure_probe(counter, rows, size or rows)
            self._current = None
            try:
                self._plan_candidates()
            except SpeedupsError as err:
                self._error = err
            return
        current = self._current
        if self._calls_on_current == 0:  # the counted call: does it fit?
            # Run smaller than planned, the call ran out of memory at its size: it does not fit.
            measured = (
                self._bytes_of(counter) if counter is not None and size == current.micro_batch_size else 2**62
            )
            if self.world > 1:
                measured = int(_agree_max([float(measured)], self._device)[0])
            if self._budget is not None and measured > self._budget:
                self.tried.append(dataclasses.replace(current, bytes=measured))
                self._current = None
                following = self._next_after(current)
                seen = [(c.micro_batch_size, c.checkpointed) for c in (*self.tried, *self._queue)]
                if following is not None and (following.micro_batch_size, following.checkpointed) not in seen:
                    self._queue.insert(0, following)
                if not self._queue:
                    self._choose()
                return
            self._current = dataclasses.replace(current, bytes=measured)
            self._calls_on_current = 1
            return
        _synchronize(self._device)
        seconds = (time.perf_counter() - self._started) / rows
        best = min(seconds, current.seconds_per_row or math.inf)  # the least disturbed of the timed calls
        self._current = dataclasses.replace(current, seconds_per_row=best)
        self._calls_on_current += 1
        if self._calls_on_current <= TIMED_CALLS:
            return
        self.tried.append(self._current)
        self._current = None
        if not self._queue:
            self._choose()

    # ----------------------------------------------------------------------------------- the planning
    def _bytes_of(self, counter: SavedActivations) -> int:
        if self._device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self._device) - self._base)
        return counter.peak_bytes

    def _measure_probe(self, counter: SavedActivations, rows: int, size: int) -> _Probe:
        size = min(size, rows)
        # The plan has checkpointed nothing yet: these are the user's, left as they are, with what they hold.
        user = [m for _, m in checkpointed_modules(self.model)]
        blocks = [
            (name, counter.bytes_by_block[name] - counter.input_bytes[name], counter.seconds_by_block[name])
            for name, block in counter.blocks
            if name and not any(block is m or overlaps(block, m) for m in user)
        ]
        stats = [self._bytes_of(counter) / size] + [max(b, 0) / rows for _, b, _ in blocks]
        stats += [s / rows for _, _, s in blocks]
        agreed = _agree_max(stats, self._device) if self.world > 1 else stats
        n = len(blocks)
        savings = [(blocks[i][0], agreed[1 + i], agreed[1 + n + i]) for i in range(n)]
        savings = [s for s in savings if s[1] > 0]
        savings.sort(key=lambda s: s[1] / max(s[2], 1e-12), reverse=True)
        return _Probe(size, agreed[0], savings)

    def _plan_candidates(self) -> None:
        probe, budget = self._probe, self._budget
        assert probe is not None
        sizes = [probe.rows] if self.fixed_size else _halvings(probe.rows)
        # On a GPU a row's bytes are the probe's measured peak and a block's saving is counted: a guess,
        # which the trials check by measuring.
        candidates: list[PlanChoice] = []
        for size in sizes:
            need = probe.per_row * size
            chosen: list[str] = []
            for name, saving, _ in probe.savings:
                if budget is None or need <= budget:
                    break
                need -= saving * size
                chosen.append(name)
            if budget is not None and need > budget:
                continue
            candidates.append(PlanChoice(size, tuple(chosen)))
            if not chosen:
                break  # smaller micro-batches with nothing to checkpoint only run slower
        if not candidates:
            rows = sizes[-1]
            smallest = max(probe.per_row - sum(s for _, s, _ in probe.savings), 0.0) * rows
            raise SpeedupsError(
                f"accumulate(..., memory_budget={self.budget_spec!r}): nothing fits in "
                f"{_size(budget or 0)}: {rows} row(s) per micro-batch with every block checkpointed keep "
                f"about {_size(int(smallest))}. Give a larger memory_budget"
                + (", or a smaller micro_batch_size." if self.fixed_size else ", or a smaller model.")
            )
        if len(candidates) == 1:
            self._finish(candidates[0])
        else:
            self._queue = candidates

    def _next_after(self, over: PlanChoice) -> PlanChoice | None:
        """The candidate to try when ``over`` measured above the budget: a block more, else half the size."""
        assert self._probe is not None
        names = [name for name, _, _ in self._probe.savings]
        blocks = len(over.checkpointed)
        if blocks < len(names):
            return PlanChoice(over.micro_batch_size, tuple(names[: blocks + 1]))
        if self.fixed_size is None and over.micro_batch_size > 1:
            return PlanChoice(math.ceil(over.micro_batch_size / 2), over.checkpointed)
        return None

    def _choose(self) -> None:
        """The fastest candidate that fit (the one with the fewest bytes, warned, if none did)."""
        fitting = [c for c in self.tried if c.seconds_per_row is not None]
        if not fitting:
            least = min(self.tried, key=lambda c: c.bytes or 0)
            if env.rank() == 0:
                warnings.warn(
                    f"accumulate(..., memory_budget={self.budget_spec!r}): no micro-batch size and set of "
                    f"checkpointed blocks tried fits {_size(self._budget or 0)}; the run goes on with the "
                    f"smallest ({least}). Give a larger memory_budget.",
                    SpeedupsWarning,
                    stacklevel=5,
                )
            self._finish(least)
            return
        times = [c.seconds_per_row or 0.0 for c in fitting]
        if self.world > 1:  # the ranks' times summed: every rank makes the same choice
            times = _agree_sum(times, self._device)
        self._finish(fitting[times.index(min(times))])

    def _finish(self, choice: PlanChoice) -> None:
        self._apply(choice.checkpointed)
        self.choice = choice
        self._queue = []

    def _apply(self, blocks: tuple[str, ...]) -> None:
        if self._own == blocks:
            return
        if self._own:
            uncheckpoint_activations(self.model, list(self._own))
        if blocks:
            checkpoint_activations(self.model, list(blocks))
        self._own = blocks

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """The choice and the budget it was made for, to resume with (None while planning: a resumed run
        plans again)."""
        if self.choice is None:
            return None
        return {
            "micro_batch_size": self.choice.micro_batch_size,
            "checkpointed": list(self.choice.checkpointed),
            "budget": self.budget_spec,
        }

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` if ``state`` is not a plan :meth:`state_dict` made for this model."""
        call = "accumulate(...).load_state_dict(state)"
        ok = (
            isinstance(state, dict)
            and isinstance(state.get("micro_batch_size"), int)
            and state["micro_batch_size"] >= 1
            and isinstance(state.get("checkpointed"), (list, tuple))
            and all(isinstance(n, str) for n in state["checkpointed"])
        )
        if not ok:
            raise ValueError(
                f"{call}: state['plan']={state!r} is not a memory plan (a dict with an int micro_batch_size "
                f">= 1 and a list of checkpointed block names). Pass what train_step.state_dict() returned."
            )
        if state["checkpointed"]:
            pick_modules(self.model, list(state["checkpointed"]), f"{call} (the saved memory plan)")

    def load_state_dict(self, state: dict[str, Any] | None) -> bool:
        """Take the choice a run saved (its micro-batch size and checkpointed blocks, no new trials) when it
        was made for this budget; return whether it was taken (another budget: this step plans anew)."""
        if state is None or state.get("budget", self.budget_spec) != self.budget_spec:
            return False
        self._finish(PlanChoice(int(state["micro_batch_size"]), tuple(state["checkpointed"])))
        return True


# ----------------------------------------------------------------------------------------------- helpers
def _halvings(rows: int) -> list[int]:
    sizes = [rows]
    while sizes[-1] > 1:
        sizes.append(math.ceil(sizes[-1] / 2))
    return sizes


def _device_of(model: nn.Module) -> torch.device:
    param = next(iter(unwrap(model).parameters()), None)
    return torch.device("cpu") if param is None else param.device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _agree(values: list[float], device: torch.device, op: Any) -> list[float]:
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return [float(v) for v in tensor.tolist()]


def _agree_max(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    return _agree(values, device, dist.ReduceOp.MAX)


def _agree_sum(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    return _agree(values, device, dist.ReduceOp.SUM)


def _size(n: float) -> str:
    """Bytes as a person reads them: ``512 bytes``, ``3.0 KiB``, ``1.5 MiB``, ``2.0 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"

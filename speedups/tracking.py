"""Tip 5: keep a running loss without keeping graphs and without a host-device sync per step.

The classic advice is "store ``loss.item()``, not ``loss``": storing the tensor keeps its autograd graph (and
every activation in it) alive, while ``.item()`` waits for the GPU on every step. :class:`LossTracker` does
neither: it adds the *detached* value into a running sum that stays on the loss's device, and syncs once,
when you read it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["LossTracker"]

# Slots of the on-device running state: [sum of n * value, sum of n, number of non-finite values].
_SUM, _COUNT, _NONFINITE = 0, 1, 2
# Device values are buffered and folded into the running state this many at a time.
_FOLD_EVERY = 256
# Plain CPU tensors are read at once (not a sync there). Tests set it False to run the device path on a CPU.
_CPU_READS_ARE_FREE = True
_NUMPY_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})


class LossTracker:
    """A weighted running mean of scalar losses that holds no graph and never syncs until read.

    ``update(loss, n)`` on a GPU (or any device but the CPU) costs no host-device sync: the detached value
    is added into a running ``(weighted sum, count)`` kept on the loss's device in float64 (float32 on MPS,
    which has no float64), and reading the mean (``compute()``, ``float()``, ``str()``, a format spec,
    ``state_dict()``) is one sync. On the CPU a read is not a sync (the value is already computed), so CPU
    tensors and Python floats are read at once and summed on the host in float64: no cost beyond ``.item()``.

    Non-finite values (NaN, +-inf) are left out of the mean and counted in :attr:`num_nonfinite`: one
    diverged micro-batch should not turn the epoch's number into NaN and hide every other value. Reading a
    mean that left values out warns (:class:`~speedups.SpeedupsWarning`) with how many. A mean over only
    non-finite values is NaN.

    Epochs: :meth:`end_epoch` appends the current mean to :attr:`history` and starts a new running mean.

    One tracker belongs to one training loop: it is not thread-safe (use one tracker per thread).

    Across ranks (opt-in): ``LossTracker(all_ranks=True)`` makes every read the global weighted mean over all
    ranks of the process group: one all-reduce of ``(weighted sum, count, non-finite count, updates)`` in
    float64 at read time, never in :meth:`update`. Ranks may record different numbers of values (an
    ``even=False`` evaluation loader); the mean weights each value by its ``n``, as one process would.
    **Every read is then a collective: every rank must read, in the same order** (``compute()``,
    ``end_epoch()``, ``float()``, formatting, ``state_dict()``), or the reading ranks wait until the process
    group's timeout. Never read it inside ``if is_main_process():`` or a ``@rank_zero_only`` function: read it
    on all ranks, then print on one. Without an initialised process group it reads the local values. It is
    opt-in rather than automatic for exactly that reason: a rank-0-only ``print(tracker)`` must not hang a
    job.

    Example:
        >>> tracker = LossTracker()
        >>> tracker.update(torch.tensor(2.0), n=3)   # a batch of 3 with mean loss 2.0
        >>> tracker.update(1.0)                       # n=1
        >>> tracker.compute()                          # (3 * 2.0 + 1 * 1.0) / 4
        1.75
        >>> f"{tracker:.2f}", len(tracker)
        ('1.75', 2)
    """

    def __init__(self, *, all_ranks: bool = False) -> None:
        """Create an empty tracker.

        Args:
            all_ranks: reads return the global mean over every rank of the process group (each read is then
                one all-reduce that every rank must join); False reads this process's values only.

        Raises:
            TypeError: ``all_ranks`` is not a bool.
        """
        with validate.arguments("LossTracker()"):
            validate.flag(all_ranks, "all_ranks")
        self.all_ranks = all_ranks
        self._state: torch.Tensor | None = None  # on-device [sum, count, nonfinite], created on first use
        self._values: list[torch.Tensor] = []  # detached device values not yet folded into _state
        self._weights: list[torch.Tensor | float] = []  # their item counts
        self._host = [0.0, 0.0, 0.0]  # the same slots for Python-number updates
        self._updates = 0
        self.history: list[float] = []
        """The mean of each finished epoch, oldest first (see :meth:`end_epoch`)."""

    # ----------------------------------------------------------------------------------------- record
    def update(self, value: torch.Tensor | float, n: int | float | torch.Tensor = 1) -> None:
        """Record one loss ``value`` that stands for ``n`` items (samples, tokens).

        No host-device sync: a device value is detached and added on its own device; a CPU value (where
        reading is not a sync) is read into a Python float, as cheap as ``.item()``.

        Args:
            value: a scalar loss: a 0-dim or one-element floating tensor on any device (its graph is not
                kept), or a Python int/float. Usually the mean loss of a micro-batch.
            n: how many items ``value`` is the mean of (default 1): a positive int or float, or a
                one-element tensor (such as a token count on the GPU, which is not checked for positivity,
                since that would sync; a read raises if the total count is not positive).

        Raises:
            TypeError: ``value`` or ``n`` is not a number or a real tensor (a string, a list, a bool,
                a complex or integer tensor for ``value``).
            ValueError: ``value`` has more than one element, or ``n`` is not a positive finite number.

        Nothing is recorded when it raises.
        """
        if type(value) is torch.Tensor and value.is_cpu and _CPU_READS_ARE_FREE:
            # On the CPU a plain tensor holds its value already: reading it is not a sync, and a Python
            # number costs nothing to keep. The common call (a float loss, a positive int count) is checked
            # inline so that it costs about what the `.item()` it replaces costs.
            if type(n) is int and n > 0 and value.dtype in _NUMPY_FLOATS and value.numel() == 1:
                v = value.numpy(force=True).item()  # see _cpu_number
                self._updates += 1
                host = self._host
                if math.isfinite(v):
                    host[_SUM] += v * n
                    host[_COUNT] += n
                else:
                    host[_NONFINITE] += 1.0
                return
            _check_value(value)
            _check_n(n)  # before anything is recorded
            if isinstance(n, torch.Tensor) and not (type(n) is torch.Tensor and n.is_cpu):
                self._record(_cpu_number(value), n)  # a device count: the loss, read here, joins it there
                return
            self._updates += 1
            # A tensor count keeps its rule: not checked for positivity per update (a read checks the total).
            self._add_host(_cpu_number(value), _cpu_number(n) if isinstance(n, torch.Tensor) else n)
            return
        _check_value(value)
        _check_n(n)
        self._record(value, n)

    def _record(self, value: torch.Tensor | float, n: int | float | torch.Tensor) -> None:
        """Record a checked ``value`` and ``n``: on the host for Python numbers, else on the device."""
        self._updates += 1
        if not isinstance(value, torch.Tensor) and not isinstance(n, torch.Tensor):
            self._add_host(value, n)
            return
        if isinstance(value, torch.Tensor):
            value = value.detach() if value.dim() == 0 else value.detach().reshape(())
        else:  # a Python loss with a device count: a fill kernel on the count's device, no copy
            value = torch.full((), float(value), dtype=_dtype(n.device), device=n.device)  # type: ignore[union-attr]
        self._values.append(value)
        self._weights.append(n.detach().reshape(()) if isinstance(n, torch.Tensor) else float(n))
        if len(self._values) >= _FOLD_EVERY:
            self._fold()

    def _add_host(self, value: float, n: float) -> None:
        """Add a Python value and its count to the host slots (float64, like the device state)."""
        v, w = float(value), float(n)
        if math.isfinite(v):
            self._host[_SUM] += v * w
            self._host[_COUNT] += w
        else:
            self._host[_NONFINITE] += 1.0

    def _fold(self) -> None:
        """Add the buffered values into the on-device running state: a few kernels, no host-device sync.

        Buffering makes :meth:`update` a detach and a list append; the arithmetic runs here, once per
        ``_FOLD_EVERY`` updates (and before any read), on whole vectors instead of scalar by scalar.
        """
        if not self._values:
            return
        device = self._state.device if self._state is not None else self._values[0].device
        dtype = _dtype(device)
        values = torch.stack([v.to(device=device, dtype=dtype) for v in self._values])
        if all(isinstance(w, float) for w in self._weights):
            weights = _host_to_device(self._weights, device)  # type: ignore[arg-type]
        else:
            weights = torch.stack(
                [
                    w.to(device=device, dtype=dtype)
                    if isinstance(w, torch.Tensor)
                    else torch.full((), w, dtype=dtype, device=device)
                    for w in self._weights
                ]
            )
        finite = torch.isfinite(values)
        zero = values.new_zeros(())
        row = torch.stack(
            [
                torch.where(finite, values * weights, zero).sum(),
                torch.where(finite, weights, zero).sum(),
                (~finite).sum().to(dtype),
            ]
        )
        self._state = row if self._state is None else self._state + row
        self._values.clear()
        self._weights.clear()

    def totals(self) -> torch.Tensor:
        """The weighted sum and the count of the finite values so far: a float64 tensor of shape ``(2,)``.

        No host-device sync and no collective: on the device of the recorded tensors (the CPU for Python
        numbers; float32 on MPS). The mean is ``totals[0] / totals[1]``, what :meth:`compute` returns for
        this rank. For readers that must not sync now, e.g. :class:`~speedups.MetricLogger`.
        """
        self._fold()
        host = torch.tensor(self._host[:2], dtype=torch.float64)
        if self._state is None:
            return host
        return self._state[:2] + host.to(device=self._state.device, dtype=self._state.dtype)

    # ------------------------------------------------------------------------------------------- read
    def _totals(self) -> tuple[float, float, float]:
        """Return (weighted sum, count, non-finite count) as Python floats. One sync if on a device."""
        return self._read()[:3]

    def _read(self) -> tuple[float, float, float, int]:
        """(weighted sum, count, non-finite count, updates): local, or summed over ranks if ``all_ranks``."""
        self._fold()
        dist = torch.distributed
        if self.all_ranks and env.pg_ready():
            # One all-reduce in float64 on the backend's device (CUDA for nccl, CPU for gloo).
            device = env.comm_device()  # this rank's GPU under NCCL, whatever the current device is
            vec = torch.tensor([*self._host, float(self._updates)], dtype=torch.float64, device=device)
            if self._state is not None:
                vec[:3] += self._state.to(device=device, dtype=torch.float64)
            arrive("LossTracker.compute")  # a read on some ranks only says so, then fails at the timeout
            dist.all_reduce(vec)  # collective: every rank must read
            total, count, nonfinite, updates = vec.tolist()  # the one host-device sync of a read
            return total, count, nonfinite, int(updates)
        totals = list(self._host)
        if self._state is not None:
            device_totals = self._state.tolist()  # the one host-device sync of a read
            totals = [a + b for a, b in zip(totals, device_totals, strict=True)]
        return totals[_SUM], totals[_COUNT], totals[_NONFINITE], self._updates

    def compute(self) -> float:
        """Return the weighted mean of the values recorded since the last reset or epoch end.

        Sync point: one host-device sync (when any value was a device tensor); with ``all_ranks=True`` and a
        process group, also one all-reduce that every rank must join.

        Returns:
            ``sum(n_i * value_i) / sum(n_i)`` over the finite values (of every rank with ``all_ranks``), as a
            Python float; NaN when every recorded value was non-finite.

        Raises:
            SpeedupsError: nothing was recorded yet, or the total item count is not positive (possible only
                with tensor ``n``).

        Warns:
            SpeedupsWarning: some values were non-finite and were left out.
        """
        total, count, nonfinite, updates = self._read()  # collective first, so no rank skips it
        if updates == 0:
            raise SpeedupsError(
                "LossTracker.compute(): no value recorded since the last reset. "
                "Call tracker.update(loss, n) at least once before reading it."
            )
        return self._mean(total, count, nonfinite, updates)

    def _mean(self, total: float, count: float, nonfinite: float, updates: int) -> float:
        if nonfinite:
            warnings.warn(
                f"LossTracker: {int(nonfinite)} of {updates} recorded values were NaN or inf and were "
                f"left out of the mean. Look for a diverging step (lower the learning rate, clip gradients).",
                SpeedupsWarning,
                stacklevel=3,
            )
        if count == 0 and nonfinite:
            return math.nan
        if count <= 0:
            raise SpeedupsError(
                f"LossTracker.compute(): the total item count is {count!r}; every n must be positive. "
                f"Pass n as the number of items the value is the mean of."
            )
        return total / count

    @property
    def num_nonfinite(self) -> int:
        """How many recorded values were NaN or inf and left out (one sync, like :meth:`compute`)."""
        return int(self._totals()[_NONFINITE])

    def __len__(self) -> int:
        """Return how many values were recorded since the last reset or epoch end (no sync)."""
        return self._updates

    def __float__(self) -> float:
        """Same as :meth:`compute` (one sync)."""
        return self.compute()

    def __format__(self, spec: str) -> str:
        """Format the mean, e.g. ``f"{tracker:.4f}"`` (one sync); ``"nan"`` formatted when empty.

        This is what a tqdm postfix needs: ``bar.set_postfix(loss=f"{tracker:.4f}")``.
        """
        total, count, nonfinite, updates = self._read()  # with all_ranks, every rank joins the collective
        value = self._mean(total, count, nonfinite, updates) if updates else math.nan
        return format(value, spec or ".4g")

    def __str__(self) -> str:
        """The mean with 4 significant digits (one sync); tqdm's ``set_postfix(loss=tracker)`` uses it."""
        return self.__format__("")

    def __repr__(self) -> str:
        return f"LossTracker(updates={self._updates}, epochs={len(self.history)})"

    # ------------------------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget the running mean (the epoch :attr:`history` is kept). No sync."""
        self._state = None
        self._values.clear()
        self._weights.clear()
        self._host = [0.0, 0.0, 0.0]
        self._updates = 0

    def end_epoch(self) -> float:
        """Close the epoch: append its mean to :attr:`history`, reset, and return the mean (one sync).

        Raises:
            SpeedupsError: nothing was recorded in this epoch.
        """
        mean = self.compute()
        self.history.append(mean)
        self.reset()
        return mean

    def state_dict(self) -> dict[str, Any]:
        """Return a checkpointable dict of Python numbers (one sync). Restore with :meth:`load_state_dict`.

        With ``all_ranks=True`` and a process group the totals are the global ones (one all-reduce: every
        rank must call it, as :func:`~speedups.save_checkpoint` does), so the dict rank 0 writes is the
        whole job's running mean; loading it puts the totals on rank 0 and zeros on the others, and the
        global mean continues unchanged.
        """
        total, count, nonfinite, updates = self._read()
        return {
            "sum": total,
            "count": count,
            "nonfinite": nonfinite,
            "updates": updates,
            "history": list(self.history),
            "all_ranks": self.all_ranks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Later updates continue the same running mean.

        Raises:
            ValueError: ``state`` lacks a key, has one this class does not know, or holds a value of the
                wrong kind (the tracker is unchanged then).
        """
        totals, updates, history = self._check_state(state)  # before anything changes
        self.reset()
        self.history = history
        dist = torch.distributed
        if state.get("all_ranks") and env.pg_ready() and dist.get_rank() != 0:
            return  # global totals: rank 0 holds them, so the all-reduce of a read counts them once
        self._host = totals
        self._updates = updates

    def _merge_rank_states(self, states: list[Any], change: Any) -> dict[str, Any]:
        """This rank's state from what every rank saved on another number of processes (``load_checkpoint``).

        ``all_ranks=True`` saved the job's totals (rank 0's state is all of it); a rank-local tracker
        continues from the totals of every saved rank, the job's running mean so far, on each rank.
        """
        for state in states:
            self._check_state(state)
        first = states[0]
        if first.get("all_ranks") or len(states) == 1:
            return dict(first)
        return {
            **first,
            "sum": math.fsum(s["sum"] for s in states),
            "count": math.fsum(s["count"] for s in states),
            "nonfinite": math.fsum(s["nonfinite"] for s in states),
        }

    def _check_state(self, state: Any) -> tuple[list[float], int, list[float]]:
        """Check ``state`` as :meth:`load_state_dict` does, changing nothing; return its converted values."""
        call = "LossTracker.load_state_dict(state)"
        expected = {"sum", "count", "nonfinite", "updates", "history"}
        if not isinstance(state, dict) or set(state) - {"all_ranks"} != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{call}: expected a dict with keys {sorted(expected)}, "
                f"got {got}. Pass what LossTracker.state_dict() returned."
            )
        totals = []
        for key in ("sum", "count", "nonfinite"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{call}: state[{key!r}]={value!r}, expected a finite number.")
            totals.append(float(value))
        updates, history = state["updates"], state["history"]
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"{call}: state['updates']={updates!r}, expected an int >= 0.")
        if not isinstance(history, list) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in history
        ):
            raise ValueError(f"{call}: state['history'] must be a list of numbers, got {history!r}.")
        return totals, updates, [float(v) for v in history]


def _cpu_number(t: torch.Tensor) -> float:
    """The value of a one-element CPU tensor as a Python number, read through NumPy, not ``.item()``.

    On the CPU neither is a sync; but ``profile_steps`` counts every ``.item()`` as one (a CPU tensor stands
    in for a device in its tests), while it rightly counts a NumPy read of a CPU tensor as none.
    """
    if t.dtype not in _NUMPY_FLOATS and t.is_floating_point():  # bfloat16 has no NumPy dtype
        t = t.detach().double()
    return t.numpy(force=True).item()


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _host_to_device(numbers: list[float], device: torch.device) -> torch.Tensor:
    """Copy Python numbers to ``device`` without a host-device sync (pinned memory, non-blocking, on CUDA)."""
    t = torch.tensor(numbers, dtype=_dtype(device))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_value(value: object) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"LossTracker.update(value=<tensor of shape {tuple(value.shape)}>): expected a scalar loss "
                f"(0-dim or one element). Reduce it first, e.g. tracker.update(loss.mean())."
            )
        if value.is_meta:
            raise ValueError(
                "LossTracker.update(value=<meta tensor>): a meta tensor holds no value to average. "
                "Record real losses (run the model on a real device)."
            )
        if not value.is_floating_point():
            raise TypeError(
                f"LossTracker.update(value=<tensor of dtype {value.dtype}>): expected a floating-point loss."
            )
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"LossTracker.update(value={value!r}): expected a scalar tensor or a Python float, "
            f"got {type(value).__name__}."
        )


def _check_n(n: object) -> None:
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.is_complex() or n.dtype == torch.bool:
            raise ValueError(
                f"LossTracker.update(n=<tensor of shape {tuple(n.shape)}, dtype {n.dtype}>): expected a "
                f"one-element real tensor (an item count)."
            )
        return
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(
            f"LossTracker.update(n={n!r}): expected a positive int or float, got {type(n).__name__}."
        )
    try:
        as_float = float(n)
    except OverflowError:  # an int beyond float range
        as_float = math.inf
    if not (math.isfinite(as_float) and as_float > 0):
        raise ValueError(
            f"LossTracker.update(n={n!r}): n is the number of items the value averages and must be positive "
            f"and finite, e.g. n=len(batch)."
        )

"""Metrics every step at no sync: :class:`MetricLogger` stages device values and writes them once landed."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups._helpers.validate import short
from speedups.accumulation import UpdateRecord
from speedups.errors import SpeedupsError
from speedups.metrics.sinks import Sink, make_sink
from speedups.tracking import LossTracker

__all__ = ["MetricLogger"]

_CPU_READS_ARE_FREE = True  # a CPU tensor holds its value: reading it is no sync (tests turn this off)


class _Record:
    """One logged step: its values as host floats and, not yet read, one flat float64 tensor per record.

    ``slots`` maps each name to its positions in ``host + flat``: one position for a value, two (weighted
    sum, count) for a :class:`~speedups.LossTracker`, whose value is their ratio.
    """

    __slots__ = ("event", "flat", "host", "slots", "step")

    def __init__(self, step: int) -> None:
        self.step = step
        self.host: list[float] = []
        self.flat: torch.Tensor | None = None  # device values, staged (pinned host copy on CUDA)
        self.event: Any = None  # CUDA: recorded after the copy to the pinned buffer
        self.slots: list[tuple[str, int, bool]] = []  # (name, first position, is a tracker's (sum, count))

    def landed(self) -> bool:
        """Whether reading the staged values now costs no sync (a CUDA copy that finished, or none)."""
        if self.flat is None:
            return True
        return self.event is not None and bool(self.event.query())

    def vector(self, device: torch.device) -> torch.Tensor:
        """Every position as one float64 tensor on ``device`` (host values first)."""
        host = torch.tensor(self.host, dtype=torch.float64, device=device)
        return host if self.flat is None else torch.cat([host, self.flat.to(device)])

    def read(self) -> list[float]:
        """Every position as host floats (a read of the staged values: a sync unless they landed)."""
        return self.host if self.flat is None else [*self.host, *self.flat.tolist()]

    def row(self, positions: Sequence[float], world: int = 1) -> dict[str, float]:
        """The values by name; plain values divided by ``world`` (a sum over ranks), trackers sum/count."""
        out = {}
        for name, at, tracker in self.slots:
            if tracker:
                total, count = positions[at], positions[at + 1]
                out[name] = total / count if count > 0 else math.nan
            else:
                out[name] = positions[at] / world
        return out


class MetricLogger:
    """Log metrics every step from device tensors without a host-device sync, to CSV, TensorBoard, trackers.

    ``log(step, loss=loss, lr=lr, tokens_per_s=...)`` takes 0-dim or one-element tensors on any device,
    Python numbers and :class:`~speedups.LossTracker` objects (their running mean). It never syncs: CUDA
    values are gathered into one float64 tensor and copied to pinned host memory asynchronously, with an
    event; a record is written once its copy has landed, checked at each ``log`` without waiting. Every
    ``every`` records, at :meth:`flush` and at :meth:`close`, whatever is pending is read (one sync). CPU
    tensors are read at once (no sync there). One writer: rank 0 writes, the other ranks only stage. With
    ``all_ranks=True`` every value is the mean over the ranks (a tracker's, the weighted mean of all their
    items), reduced with one all-reduce per flush, never per ``log``: every rank must log the same names at
    the same steps. Accelerate's ``accelerator.log`` and Fabric's ``fabric.log`` read each value when called.

    Sinks (chosen by name or given as objects): ``"csv"`` (``log_dir/metrics.csv``), ``"jsonl"``
    (``metrics.jsonl``), ``"tensorboard"`` (``log_dir/tensorboard``, the ``tensorboard`` extra), ``"wandb"``,
    ``"mlflow"`` (their own clients, extras), a :class:`~speedups.metrics.sinks.Sink`, or any object with
    ``log_metrics(metrics, step)``. A missing optional package is an ``ImportError`` here, not at step 10,000.

    Sync points: none in :meth:`log` (an every-``every``-records read); :meth:`flush`, :meth:`close` and
    :meth:`state_dict` read what is pending (one sync) and, with ``all_ranks``, run one all-reduce (every
    rank must call them; one that does not is named after 10 s).

    Args:
        log_dir: the run's directory for file sinks (made when first written); None: no file sinks.
        sinks: a sink name, a sink or tracker object, or a list of them (default ``"csv"``).
        every: read and write whatever is pending at least every this many records (>= 1).
        all_ranks: log the mean over all ranks (one all-reduce per flush) instead of rank 0's values.
        enabled: False makes every method a no-op.

    Raises:
        TypeError, ValueError: a bad argument, an unknown sink name, a file sink without ``log_dir``.
        ImportError: a sink's optional package is missing (the message names the extra to install).

    Example:
        >>> import tempfile
        >>> with MetricLogger(tempfile.mkdtemp(), sinks="csv") as logger:
        ...     for step in range(3):
        ...         logger.log(step, loss=torch.tensor(1.0 / (step + 1)), lr=0.1)
        >>> logger.postfix()
        {'loss': '0.3333', 'lr': '0.1'}
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        sinks: Any = "csv",
        *,
        every: int = 50,
        all_ranks: bool = False,
        enabled: bool = True,
    ) -> None:
        with validate.arguments(f"MetricLogger({short(log_dir)}, sinks={short(sinks)})"):
            named = isinstance(log_dir, (str, os.PathLike)) and bool(os.fspath(log_dir))
            if log_dir is not None and not named:
                raise TypeError(f"log_dir={short(log_dir)}: expected a directory name (str or Path) or None.")
            validate.integer(every, "every", minimum=1, example="50")
            validate.flag(all_ranks, "all_ranks")
            validate.flag(enabled, "enabled")
            specs = list(sinks) if isinstance(sinks, (list, tuple)) else [sinks]
            if not specs:
                raise ValueError("sinks=[]: expected at least one sink. Write sinks='csv'.")
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.every = every
        self.all_ranks = all_ranks
        self.enabled = enabled
        self.sinks: list[Sink] = [make_sink(spec, self.log_dir) for spec in specs] if enabled else []
        self._pending: list[_Record] = []
        self._last_step: int | None = None  # the last step logged
        self._latest: dict[str, float] = {}  # the last values written, by name (host floats)
        self._closed = False

    # ------------------------------------------------------------------------------------------- log
    def log(self, step: int, /, **values: Any) -> None:
        """Record ``values`` at ``step`` (an int, not below the last one logged: the same step again adds a
        row, e.g. evaluation metrics beside the training ones). No sync.

        Raises:
            TypeError: a value is not a number, a one-element real tensor or a LossTracker; ``step`` not an
                int.
            ValueError: ``step`` below the last step logged (a resumed run continues after it);
                a tensor with more than one element.
            SpeedupsError: logging after :meth:`close`.
        """
        if not self.enabled:
            return
        if type(step) is not int or (self._last_step is not None and step < self._last_step):
            self._refuse_step(step)
        if self._closed:
            raise SpeedupsError("MetricLogger.log(...): the logger is closed. Log before close().")
        record = _Record(step)
        staged: list[torch.Tensor] = []
        width = 0  # positions in host + staged so far
        host_slots: list[tuple[str, int, bool]] = []
        device_slots: list[tuple[str, int, bool]] = []
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or value.is_complex():
                    raise ValueError(
                        f"MetricLogger.log({step}, {name}=<tensor of shape {tuple(value.shape)}>): a metric "
                        f"is one real number. Reduce it first, e.g. {name}={name}.mean()."
                    )
                if value.is_cpu and _CPU_READS_ARE_FREE:
                    host_slots.append((name, len(record.host), False))
                    record.host.append(float(value))
                else:
                    device_slots.append((name, width, False))
                    staged.append(value.detach().reshape(1).to(torch.float64))
                    width += 1
            elif isinstance(value, LossTracker):
                totals = value.totals()
                if totals.is_cpu and _CPU_READS_ARE_FREE:
                    host_slots.append((name, len(record.host), True))
                    record.host.extend(totals.tolist())
                else:
                    device_slots.append((name, width, True))
                    staged.append(totals.to(torch.float64))
                    width += 2
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                host_slots.append((name, len(record.host), False))
                record.host.append(float(value))
            elif value is None:
                continue  # an optional value (a grad norm not computed): not logged at this step
            else:
                raise TypeError(
                    f"MetricLogger.log({step}, {name}={short(value)}): expected a number, a one-element real "
                    f"tensor or a LossTracker, got {type(value).__name__}."
                )
        offset = len(record.host)
        record.slots = host_slots + [(name, offset + at, tracker) for name, at, tracker in device_slots]
        if staged:
            record.flat, record.event = _stage(staged)
        self._last_step = step
        self._pending.append(record)
        if len(self._pending) >= self.every:
            self.flush()
        elif not self.all_ranks:
            self._write(block=False)

    def log_update(self, record: UpdateRecord) -> None:
        """Log an ``@accumulate`` update at step ``num_updates``: ``loss``, ``lr`` (``lr_0``, ``lr_1``, ...
        with several param groups), ``grad_norm`` where computed, ``num_items`` where counted. No sync.

        Register it as the step's hook: ``train_step.on_update(logger.log_update)``.
        """
        lrs = record.lrs
        rates = {"lr": lrs[0]} if len(lrs) == 1 else {f"lr_{i}": lr for i, lr in enumerate(lrs)}
        self.log(
            record.num_updates,
            loss=record.loss,
            **rates,
            grad_norm=record.grad_norm,
            num_items=record.num_items,
        )

    def _refuse_step(self, step: Any) -> None:
        if type(step) is not int:
            raise TypeError(f"MetricLogger.log(step={short(step)}): expected an int (the step), first.")
        raise ValueError(
            f"MetricLogger.log(step={step}): steps must not go back; the last one logged was "
            f"{self._last_step}. Log in step order (a resumed run continues after the checkpoint's step)."
        )

    # ----------------------------------------------------------------------------------------- write
    def _write(self, *, block: bool) -> None:
        """Write the pending records in order: those landed, or all when ``block`` (reading them syncs)."""
        written = 0
        for record in self._pending:
            if not block and not record.landed():
                break
            self._emit(record.step, record.row(record.read()))
            written += 1
        del self._pending[:written]

    def _emit(self, step: int, values: dict[str, float]) -> None:
        self._latest.update(values)
        if env.rank() == 0:
            for sink in self.sinks:
                sink.write(step, values)

    def flush(self) -> None:
        """Read and write everything pending (one sync; with ``all_ranks``, one all-reduce on every rank)."""
        if not self.enabled:
            return
        if self.all_ranks and env.pg_ready() and env.world_size() > 1:
            self._reduce_and_write()
        else:
            self._write(block=True)
        if env.rank() == 0:
            for sink in self.sinks:
                sink.flush()

    def _reduce_and_write(self) -> None:
        """One all-reduce of every pending record's values, then the means are written (rank 0)."""
        arrive("MetricLogger.flush")
        dist = torch.distributed
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        pending, self._pending = self._pending, []
        if not pending:
            dist.all_reduce(torch.zeros(1, dtype=torch.float64, device=device))  # keep the ranks in step
            return
        vectors = [record.vector(device) for record in pending]
        summed = torch.cat(vectors)
        dist.all_reduce(summed)  # collective: every rank flushes, with the same records
        values = summed.tolist()  # the one host-device sync of a flush
        world, at = dist.get_world_size(), 0
        for record, vector in zip(pending, vectors, strict=True):
            self._emit(record.step, record.row(values[at : at + len(vector)], world))
            at += len(vector)

    def close(self) -> None:
        """Flush, then close every sink; later calls do nothing (and :meth:`log` raises)."""
        if self._closed or not self.enabled:
            return
        self.flush()
        self._closed = True
        if env.rank() == 0:
            for sink in self.sinks:
                sink.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ host values
    def postfix(self, digits: int = 4) -> dict[str, str]:
        """The last written values, formatted for ``tqdm``'s ``set_postfix``: host values only, no read."""
        return {name: f"{value:.{digits}g}" for name, value in self._latest.items()}

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The logger's position: the last step logged, after a flush (so the files hold it).

        A resumed run's :meth:`load_state_dict` makes the sinks keep what was written up to that step and
        append after it: every step once, none missing, none twice. A sync and, with ``all_ranks``, a
        collective (the flush).
        """
        self.flush()
        return {"step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved step (see :meth:`state_dict`); the sinks drop rows written after it.

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns (nothing changed).
        """
        self._check_state(state)
        self._last_step = state["step"]
        self._pending = []
        if state["step"] is not None:
            for sink in self.sinks:
                sink.resume(state["step"])

    def _check_state(self, state: Any) -> None:
        step = state.get("step", -1) if isinstance(state, Mapping) else -1
        if not isinstance(state, Mapping) or (step is not None and (type(step) is not int or step < 0)):
            raise ValueError(
                f"MetricLogger.load_state_dict({short(state)}): expected what MetricLogger.state_dict() "
                f"returns, {{'step': int or None}}."
            )


def _stage(values: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """One float64 tensor of ``values``, copied to pinned host memory without waiting on CUDA (+ its event).

    Other devices (and the CPU stand-in of the tests) keep the tensor where it is, read at the next flush.
    """
    device = values[0].device
    flat = torch.cat([v.to(device, non_blocking=True) for v in values])
    if device.type != "cuda":
        return flat, None
    pinned = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
    pinned.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return pinned, event

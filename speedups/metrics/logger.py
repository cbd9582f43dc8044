"""Metrics every step at no sync: :class:`MetricLogger` stages device values and writes them once landed."""

from __future__ import annotations

import contextlib
import hashlib
import math
import multiprocessing
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups._helpers.validate import short
from speedups.accumulation import UpdateRecord
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.metrics.sinks import Sink, make_sink
from speedups.metrics.sinks.registry import sink_named
from speedups.tracking import LossTracker

__all__ = ["MetricLogger"]

_CPU_READS_ARE_FREE = True  # a CPU tensor holds its value: reading it is no sync (tests turn this off)
_ALONE_AFTER_S = 5.0  # log_update: seconds rank 0 waits, once, for the other ranks (tests lower it)
_Tensor = torch.Tensor


class _Record:
    """One logged step: its host values as floats and its device values stacked into one tensor (not read).

    ``row`` holds the plain host values by name; ``pairs`` the host :class:`~speedups.LossTracker` values as
    ``(name, weighted sum, count)``; ``names`` the device slots, in the order of ``flat``: ``(name, False)``
    for a value (one element), ``(name, True)`` for a tracker (two: sum, count). ``order`` is the order the
    names were logged in, kept in the row written. ``late`` holds ``(name, totals, work)``: a ``(sum, count)``
    tensor an asynchronous all-reduce (``work``) is still summing, joined to ``flat`` by :meth:`settle`.
    """

    __slots__ = ("flat", "late", "names", "order", "pairs", "row", "step")

    def __init__(self, step: int, row: dict[str, float], order: tuple[str, ...]) -> None:
        self.step = step
        self.row = row
        self.order = order
        self.pairs: list[tuple[str, float, float]] | None = None
        self.names: list[tuple[str, bool]] | None = None
        self.flat: torch.Tensor | None = None
        self.late: list[tuple[str, torch.Tensor, Any]] | None = None

    def ready(self) -> bool:
        """Whether every all-reduce of :attr:`late` has finished (a query, no wait)."""
        return self.late is None or all(work is None or work.is_completed() for _, _, work in self.late)

    def settle(self) -> None:
        """Wait for the all-reduces of :attr:`late` and join their totals to ``flat`` as tracker slots.

        A wait: under gloo, until every rank's all-reduce is done (issued updates ago, as a rule); under
        NCCL the stream waits, not the host.
        """
        if self.late is None:
            return
        names = list(self.names or ())
        parts = [] if self.flat is None else [self.flat.to(torch.float64)]
        home = parts[0].device if parts else self.late[0][1].device
        for name, totals, work in self.late:
            if work is not None:
                work.wait()
            names.append((name, True))
            parts.append(totals.to(home, torch.float64, non_blocking=True))
        self.names, self.flat, self.late = names, torch.cat(parts), None

    def width(self) -> int:
        """How many numbers the record adds to an all-reduce: host values, tracker pairs, device values."""
        device = 0 if self.flat is None else self.flat.numel()
        return len(self.row) + 2 * len(self.pairs or ()) + device

    def numbers(self) -> list[float]:
        """The host numbers in all-reduce order: plain values, then each tracker's (sum, count)."""
        out = list(self.row.values())
        for _, total, count in self.pairs or ():
            out += (total, count)
        return out

    def values(
        self, device: Sequence[float] = (), host: Sequence[float] | None = None, world: int = 1
    ) -> dict[str, float]:
        """The row to write: ``device`` are the read values of ``flat``; ``host`` (with ``world``) the
        all-reduced sums of :meth:`numbers` (plain values are divided by ``world``; trackers sum/count)."""
        if host is None and self.pairs is None and self.names is None:
            return self.row
        out: dict[str, float] = {}
        at = 0
        if host is None:
            out.update(self.row)
            pairs = self.pairs or ()
        else:
            for name in self.row:
                out[name] = host[at] / world
                at += 1
            pairs = []
            for name, *_ in self.pairs or ():
                pairs.append((name, host[at], host[at + 1]))
                at += 2
        for name, total, count in pairs:
            out[name] = _ratio(total, count)
        at = 0
        for name, tracker in self.names or ():
            if tracker:
                total, count = device[at], device[at + 1]
                out[name] = _ratio(total, count)
                at += 2
            else:
                out[name] = device[at] / world
                at += 1
        return {name: out[name] for name in self.order if name in out}


def _writer_now() -> bool | None:
    """Whether this process writes (rank 0), where that is known when a logger is made: a launcher's
    variables or a process group say, or a process nobody started (a script, a notebook) is the only one.
    None in a child process before its process group (``mp.spawn``): decided at the first write."""
    if env.pg_ready() or env.launch_style() != "single":
        return env.rank() == 0
    return True if multiprocessing.parent_process() is None else None


def _missing(folder: Path) -> list[Path]:
    """``folder`` and the folders above it that do not exist yet, deepest first."""
    missing = []
    for place in (folder, *folder.parents):
        if place.exists():
            break
        missing.append(place)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: what a failed logger made and left empty
    goes; a folder something was written into (a tracker's log of why it failed) stays, with those above."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _ratio(total: float, count: float) -> float:
    """A tracker's mean from its weighted sum and count: NaN before any item."""
    return total / count if count > 0 else math.nan


def _on_every_sink(sinks: list[Sink], action: Any, message: str) -> None:
    """Run ``action(sink)`` on every sink, then raise for the first that failed (``message`` formatted with
    its ``name`` and ``error``): one failing sink never keeps the others from their turn."""
    failed = []
    for sink in sinks:
        try:
            action(sink)
        except Exception as err:
            failed.append((sink, err))
    if failed:
        bad, cause = failed[0]
        raise SpeedupsError(
            message.format(name=repr(bad.name), error=f"{type(cause).__name__}: {cause}")
        ) from cause


def _number(step: int, name: str, value: Any) -> float:
    """``value`` as a float; a number beyond float's range is an error naming it."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"MetricLogger.log({step}, {name}={short(value)}): too large for a float (metrics are written as "
            f"float64, exact for integers up to 2**53)."
        ) from None


def _layout(records: list[_Record]) -> str:
    """What an all-reduce of ``records`` carries, for every rank to compare: rows, steps, names, width."""
    if not records:
        return "no rows"
    shapes = [
        (r.step, tuple(r.row), tuple(p[0] for p in r.pairs or ()), tuple(r.names or ())) for r in records
    ]
    names = sorted(
        {name for _, row, pairs, device in shapes for name in (*row, *pairs, *(n for n, _ in device))}
    )
    width = sum(r.width() for r in records)
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:8]
    return (
        f"{len(records)} rows, steps {records[0].step}..{records[-1].step}, names {', '.join(names)}, "
        f"{width} numbers, layout {digest}"
    )


def _as_record(item: _Record | tuple[int, dict[str, float]]) -> _Record:
    """A pending entry as a record: ``(step, row)`` is a step of host values only."""
    if isinstance(item, _Record):
        return item
    return _Record(item[0], item[1], tuple(item[1]))


class _Batch:
    """Records whose device values were copied to the host together: one copy (pinned, with an event on
    CUDA) for the whole batch, read once it has landed."""

    __slots__ = ("event", "pending", "values")

    def __init__(self, pending: list[_Record | tuple[int, dict[str, float]]]) -> None:
        self.pending = pending
        for record in pending:
            if isinstance(record, _Record):
                record.settle()
        flats = [r.flat for r in pending if isinstance(r, _Record) and r.flat is not None]
        self.values: torch.Tensor | None = None
        self.event: Any = None
        if flats:
            home = flats[0].device  # records may sit on different GPUs: copies between GPUs do not wait
            flat = torch.cat([f.to(home, non_blocking=True) for f in flats]).to(torch.float64)
            if flat.device.type == "cuda":  # no wait: a pinned copy and an event to check later
                self.values = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
                self.values.copy_(flat, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()
            else:
                self.values = flat

    def landed(self) -> bool:
        """Whether reading the values now waits for nothing (a CUDA copy that finished, or no copy)."""
        return self.values is None or self.event is None or bool(self.event.query())

    def rows(self) -> list[tuple[int, dict[str, float]]]:
        """Every record's row (a read of the device values: a sync unless they landed)."""
        device = [] if self.values is None else self.values.tolist()
        out, at = [], 0
        for item in self.pending:
            if not isinstance(item, _Record):  # (step, row): host values only
                out.append(item)
                continue
            width = 0 if item.flat is None else item.flat.numel()
            out.append((item.step, item.values(device[at : at + width])))
            at += width
        return out


class MetricLogger:
    """Log metrics every step from device tensors without a host-device sync, to CSV, TensorBoard, trackers.

    ``log(step, loss=loss, lr=lr, tokens_per_s=...)`` takes 0-dim or one-element tensors on any device,
    Python numbers and :class:`~speedups.LossTracker` objects (their running mean). It never syncs: a
    step's device values are stacked on their device; every ``every`` records, those logged since are
    gathered into one float64 tensor and copied to pinned host memory asynchronously (CUDA), with an event,
    and written at the first later check (the next ``every`` records) that finds the copy landed, without
    waiting. :meth:`flush`, :meth:`close` and :meth:`state_dict` wait for everything (one sync). Numbers and
    CPU tensors are read at ``log`` (no sync there) and written with the batch: writing is batched, about
    7 µs per ``log`` of five values on a CPU (``benchmarks/metrics.py``). One writer: rank 0 writes, the
    other ranks neither read nor write (with ``all_ranks``, they take part in the reduction); and one
    writer per file: a second logger on the same files, in this process or another, is refused when made
    (each file sink holds ``<file>.lock`` until :meth:`close`). A new run in a used ``log_dir`` moves the
    earlier run's files aside (``metrics.earlier-1.csv``, ...) with a warning; a resumed one (see
    :meth:`state_dict`) keeps its rows up to the checkpoint. With
    ``all_ranks=True`` every value is the mean over the ranks (a tracker's, the weighted mean of all their
    items), reduced with one all-reduce per flush, never per ``log``: every rank must log the same names at
    the same steps. Accelerate's ``accelerator.log`` and Fabric's ``fabric.log`` read each value when called.

    Sinks (chosen by name or given as objects): ``"csv"`` (``log_dir/metrics.csv``), ``"jsonl"``
    (``metrics.jsonl``), ``"tensorboard"`` (``log_dir/tensorboard``, the ``tensorboard`` extra), ``"wandb"``,
    ``"mlflow"`` (their own clients, extras), a :class:`~speedups.metrics.sinks.Sink`, or any object with
    ``log_metrics(metrics, step)``. A missing optional package is an ``ImportError`` here, not at step 10,000.

    Sync points: none in :meth:`log` on CUDA (other devices: the every-``every``-records read);
    :meth:`flush`, :meth:`close` and
    :meth:`state_dict` read what is pending (one sync) and, with ``all_ranks``, run one all-reduce (every
    rank must call them; one that does not is named after 10 s).

    Args:
        log_dir: the run's directory for file sinks (made now, by the writing rank); None: no file sinks.
        sinks: a sink name, a sink or tracker object, or a list of them (default ``"csv"``).
        every: read and write whatever is pending at least every this many records (>= 1).
        all_ranks: log the mean over all ranks (one all-reduce per flush) instead of rank 0's values.
        enabled: False makes every method a no-op.

    Raises:
        TypeError, ValueError: a bad argument, an unknown sink name, a file sink without ``log_dir``, a
            ``log_dir`` that cannot be made or written (the message names it).
        ImportError: a sink's optional package is missing (the message names the extra to install).
        SpeedupsError: another logger writes the same files (the message names them and the fixes); a
            tracker sink cannot start (its error). A logger that fails here leaves nothing it made: the
            sinks it made are closed (a W&B run started is finished), its locks let go, and a ``log_dir`` it
            made is removed while empty.

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
                raise ValueError(f"sinks={sinks!r}: expected at least one sink. Write sinks='csv'.")
            names = [spec for spec in specs if isinstance(spec, str)]
            for name in names:  # also with enabled=False, where no sink is made
                sink_named(name)
            twice = sorted({name for name in names if names.count(name) > 1})
            if twice:
                raise ValueError(f"sinks={specs!r}: {twice[0]!r} twice would write the same rows twice.")
            folder = Path(log_dir) if log_dir is not None else None
            if folder is not None and folder.exists() and not folder.is_dir():
                raise ValueError(
                    f"log_dir={str(folder)!r} is a file: expected a directory (made if missing)."
                )
        self._call = f"MetricLogger({short(log_dir)}, sinks={short(sinks)})"
        self.log_dir = folder
        self.every = every
        self.all_ranks = all_ranks
        self.enabled = enabled
        self._pending: list[_Record | tuple[int, dict[str, float]]] = []  # logged, not staged: records,
        # or (step, row) for a step of host values only
        self._in_flight: list[_Batch] = []  # staged (copies started), written once landed
        self._last_step: int | None = None  # the last step logged
        self._floor = 0  # the lowest step log() takes: 0, then the last one logged
        self._row_step: int | None = None  # the step of the last row logged, and how many rows it has
        self._rows_at_step = 0
        self._latest: dict[str, float] = {}  # the last values written, by name (host floats)
        self._writer: bool | None = _writer_now()  # whether this rank writes: None until it is known
        self._global_loss: bool | None = None  # log_update: the job's loss (every rank calls it)
        self._closed = False
        self.sinks: list[Sink] = []
        if not enabled:
            return
        # the folders this writer may make (a sink may, too: W&B's), removed again if the logger fails here
        missing = _missing(self.log_dir) if self._writer is not False and self.log_dir is not None else []
        try:
            for spec in specs:
                self.sinks.append(make_sink(spec, self.log_dir))
            if self._writer is not False:
                self._make_dir()
            if self._writer:
                self._claim()
        except BaseException:
            for spec, sink in zip(specs, self.sinks, strict=False):  # the sinks made here from a name
                if isinstance(spec, str):
                    with contextlib.suppress(Exception):
                        sink.close()  # a W&B run started is finished; a lock taken was let go by _claim
            _remove_empty(missing)
            raise

    def _make_dir(self) -> None:
        """Make ``log_dir`` now, so that a path that cannot be a directory fails here, not at a write."""
        if self.log_dir is None:
            return
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            writable = os.access(self.log_dir, os.W_OK | os.X_OK)
        except OSError as err:
            raise ValueError(
                f"{self._call}: log_dir={str(self.log_dir)!r} cannot be made ({type(err).__name__}: "
                f"{err.strerror or err}). Pass a directory this process can create and write, e.g. "
                f"MetricLogger('runs/my_run')."
            ) from None
        if not writable:
            raise ValueError(
                f"{self._call}: log_dir={str(self.log_dir)!r} is not writable by this process. Pass a "
                f"directory it can write, e.g. MetricLogger('runs/my_run')."
            )

    def _claim(self) -> None:
        """Take every sink's files for this logger alone (the writer only); undone if one is taken."""
        claimed: list[Sink] = []
        try:
            for sink in self.sinks:
                sink.claim()
                claimed.append(sink)
        except SpeedupsError as err:
            for sink in claimed:
                sink.close()
            raise SpeedupsError(f"{self._call}: {err}") from None

    # ------------------------------------------------------------------------------------------- log
    def log(self, step: int, /, **values: Any) -> None:
        """Record ``values`` at ``step`` (an int, not below the last one logged: the same step again adds a
        row, e.g. evaluation metrics beside the training ones). No sync: device values are stacked on their
        device (a snapshot: changing the tensor later does not change what is written).

        Raises:
            TypeError: a value is not a number, a one-element real tensor or a LossTracker; ``step`` not an
                int.
            ValueError: ``step`` below the last step logged (a resumed run continues after it); a tensor
                with more than one element.
            SpeedupsError: logging after :meth:`close`.
        """
        if not self.enabled:
            return
        self._log(step, values, None)

    def _log(self, step: int, values: dict[str, Any], late: tuple[str, torch.Tensor, Any] | None) -> None:
        """:meth:`log`, with ``late``: a ``(name, (sum, count) tensor, all-reduce work)`` of log_update."""
        if self._closed:
            raise SpeedupsError("MetricLogger.log(...): the logger is closed. Log before close().")
        if type(step) is not int or step < self._floor:
            self._refuse_step(step)
        if "step" in values:
            raise ValueError(
                f"MetricLogger.log({step}, step=...): 'step' is the row's own column (the first argument). "
                f"Name the metric otherwise, e.g. global_step=..."
            )
        row: dict[str, float] = {}
        rest: list[tuple[str, Any]] | None = None  # device tensors, trackers, anything unusual
        for name, value in values.items():  # the common kinds first, in as few steps as possible
            kind = type(value)
            if kind is float:
                row[name] = value
            elif kind is int:
                row[name] = _number(step, name, value)
            elif kind is _Tensor and _CPU_READS_ARE_FREE and value.is_cpu:
                try:
                    row[name] = float(value.item())  # a CPU value: reading it is no sync
                except (RuntimeError, TypeError):  # more than one element, or complex
                    self._refuse_tensor(step, name, value)
            else:
                rest = [] if rest is None else rest
                rest.append((name, value))
        record: _Record | tuple[int, dict[str, float]] | None = None
        if late is not None:
            order = (late[0], *values)
            record = self._record(step, row, rest or [], order) or _Record(step, row, order)
            record.late = [late]
        elif rest is not None:
            record = self._record(step, row, rest, tuple(values))
        elif row:
            record = (step, row)
        if record is not None:
            self._pending.append(record)
            if step == self._row_step:  # rows per step: a resume keeps those logged before its checkpoint
                self._rows_at_step += 1
            else:
                self._row_step, self._rows_at_step = step, 1
        self._last_step = self._floor = step  # a step with no value (all None) writes no row
        if len(self._pending) >= self.every:
            self._flush(block=False)

    def _record(
        self, step: int, row: dict[str, float], rest: list[tuple[str, Any]], order: tuple
    ) -> _Record | None:
        """The record of a step with device tensors or trackers: device values stacked on one device (the
        first one's; a copy there from another GPU is asynchronous). None when every value was None."""
        record = _Record(step, row, order)
        names: list[tuple[str, bool]] = []
        device: list[torch.Tensor] = []
        for name, value in rest:
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or value.is_complex() or value.is_meta or value.layout != torch.strided:
                    self._refuse_tensor(step, name, value)
                if value.is_cpu and _CPU_READS_ARE_FREE:
                    row[name] = float(value.item())
                    continue
                names.append((name, False))
                if not value.is_floating_point():  # an integer count: exact in float64, not float32
                    value = value.double()
                value = value.detach().reshape(())
                if device and value.device != device[0].device:  # model parallel: a loss on another GPU
                    value = value.to(device[0].device, non_blocking=value.device.type != "cpu")
                device.append(value)
            elif isinstance(value, LossTracker):
                totals = value.totals()
                if totals.is_cpu and _CPU_READS_ARE_FREE:
                    total, count = totals.tolist()
                    record.pairs = [*(record.pairs or ()), (name, total, count)]
                else:
                    names.append((name, True))
                    device.extend(totals.unbind())
            elif value is None:
                continue  # an optional value (a grad norm not computed): not logged at this step
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # NumPy's bool_ is not Real
                row[name] = _number(step, name, value)  # a subclass of int or float, a NumPy scalar
            else:
                raise TypeError(
                    f"MetricLogger.log({step}, {name}={short(value)}): expected a number, a one-element real "
                    f"tensor or a LossTracker, got {type(value).__name__}."
                )
        if not names and record.pairs is None and not row:
            return None
        if names:
            record.names = names
            record.flat = torch.stack(device)  # one stack on the device (dtypes promoted): no read, no sync
        elif record.pairs is None:  # host values only after all: keep the order they were logged in
            record.row = {name: row[name] for name in order if name in row}
        return record

    def _refuse_tensor(self, step: int, name: str, value: torch.Tensor) -> None:
        if value.is_meta:
            raise ValueError(
                f"MetricLogger.log({step}, {name}=<meta tensor>): a meta tensor has no value to log. Log a "
                f"tensor on a real device."
            )
        if value.layout != torch.strided:
            raise ValueError(
                f"MetricLogger.log({step}, {name}=<{value.layout} tensor>): expected a dense tensor. Log "
                f"{name}.to_dense()."
            )
        if value.numel() != 1:
            raise ValueError(
                f"MetricLogger.log({step}, {name}=<tensor of shape {tuple(value.shape)}>): a metric is one "
                f"real number. Reduce it first, e.g. {name}={name}.mean()."
            )
        raise ValueError(
            f"MetricLogger.log({step}, {name}=<complex tensor>): a metric is one real number. Log "
            f"{name}.abs() or {name}.real."
        )

    def log_update(self, record: UpdateRecord) -> None:
        """Log an ``@accumulate`` update at step ``num_updates``: ``loss``, ``lr`` (``lr_0``, ``lr_1``, ...
        with several param groups), ``grad_norm`` where computed, ``num_items`` where counted. No sync.

        Register it as the step's hook on every rank: ``train_step.on_update(logger.log_update)``. Whose
        values: ``loss`` is the job's mean over every rank's micro-batches of the window (weighted by the
        items when the step returns ``(loss, num_items)``), what one process with the same global batch
        logs; ``num_items`` counts every rank's items; ``grad_norm`` is the norm of the synced gradient the
        optimizer applied, and ``lr`` the optimizer's, both the same on every rank.

        Sync points: none. Under several processes the window's ``(sum, count)`` goes into one asynchronous
        all-reduce per update (``async_op=True``), waited for when its row is written; ``all_ranks=True``
        sums it in the flush's all-reduce instead. The first call checks, once, that every rank calls it
        (a few store round trips); where rank 0 is alone after 5 s (the hook registered under ``if rank ==
        0:``, a logger disabled elsewhere), it logs rank 0's own loss, with a warning.

        Raises:
            TypeError: ``record`` is not an :class:`~speedups.accumulation.UpdateRecord`.
        """
        if not isinstance(record, UpdateRecord):
            raise TypeError(
                f"MetricLogger.log_update({short(record)}): expected the UpdateRecord an @accumulate step "
                f"hands its hooks. Register it: train_step.on_update(logger.log_update)."
            )
        if not self.enabled:
            return
        lrs = record.lrs
        rates = {"lr": lrs[0]} if len(lrs) == 1 else {f"lr_{i}": lr for i, lr in enumerate(lrs)}
        values = {**rates, "grad_norm": record.grad_norm, "num_items": record.num_items}
        totals = record.loss_totals() if self._job_loss() else None
        if totals is None:  # one process, the loss of a window no hook saw, or rank 0 alone
            self._log(record.num_updates, {"loss": record.loss, **values}, None)
            return
        work = None
        if not self.all_ranks:  # every rank issues it here, at the same update: no wait now
            if torch.distributed.get_backend() == "nccl" and totals.device.type != "cuda":
                totals = totals.to(env.comm_device())
            work = torch.distributed.all_reduce(totals, async_op=True)
        self._log(record.num_updates, values, ("loss", totals, work))

    def _job_loss(self) -> bool:
        """Whether log_update logs the job's loss: several processes, every rank calling it (checked once)."""
        if not (env.pg_ready() and env.world_size() > 1):
            return False
        if self.all_ranks:  # the flush is collective already: every rank logs
            return True
        if self._global_loss is None:
            self._global_loss = arrive("MetricLogger.log_update", alone_after_s=_ALONE_AFTER_S)
            if not self._global_loss and env.rank() == 0:
                warnings.warn(
                    f"MetricLogger.log_update: the other ranks did not call it within {_ALONE_AFTER_S:g} s "
                    f"of rank 0's first update, so its 'loss' column is rank 0's own loss, not the job's "
                    f"mean. Make the logger and register train_step.on_update(logger.log_update) on every "
                    f"rank (not under `if rank == 0:`); rank 0 alone writes.",
                    SpeedupsWarning,
                    stacklevel=3,
                )
        return self._global_loss

    def _refuse_step(self, step: Any) -> None:
        if type(step) is not int:
            raise TypeError(f"MetricLogger.log(step={short(step)}): expected an int (the step), first.")
        if self._last_step is None:
            raise ValueError(f"MetricLogger.log(step={step}): expected a step >= 0.")
        raise ValueError(
            f"MetricLogger.log(step={step}): steps must not go back; the last one logged was "
            f"{self._last_step}. Log in step order (a resumed run continues after the checkpoint's step)."
        )

    # ----------------------------------------------------------------------------------------- write
    def _writes(self) -> bool:
        """Whether this process is the writer (rank 0): decided when made where the rank was known, else at
        the first write (then the sinks are claimed), and kept."""
        if self._writer is None:
            self._writer = env.rank() == 0
            if self._writer and self.enabled:
                self._claim()
        return self._writer

    def _emit(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        if not rows:
            return
        latest = self._latest
        for _, values in rows:
            latest.update(values)
        _on_every_sink(  # a sink that fails costs its own rows, never the other sinks'
            self.sinks,
            lambda sink: sink.write_rows(rows),
            f"MetricLogger: the {{name}} sink failed to write steps {rows[0][0]}..{rows[-1][0]} ({{error}}); "
            f"those rows are lost for it, the other sinks have them.",
        )

    def _flush(self, *, block: bool) -> None:
        """Stage what is pending (one copy), then write every batch that landed, or all when ``block``."""
        if self.all_ranks and env.pg_ready() and env.world_size() > 1:
            self._reduce_and_write()  # a collective, and a read: every batch at once
            return
        ready = self._pending if block else self._ready()
        if not self._writes():  # not the writer: nothing to read, nothing to write (its all-reduces done)
            for record in ready:
                if isinstance(record, _Record):
                    record.settle()
            self._pending, self._in_flight = self._pending[len(ready) :], []
            return
        if ready:
            self._in_flight.append(_Batch(ready))
            self._pending = self._pending[len(ready) :]
        while self._in_flight and (block or self._in_flight[0].landed()):
            self._emit(self._in_flight.pop(0).rows())

    def _ready(self) -> list[_Record | tuple[int, dict[str, float]]]:
        """The pending records, up to the first whose loss all-reduce (log_update) is still running."""
        for at, record in enumerate(self._pending):
            if isinstance(record, _Record) and not record.ready():
                return self._pending[:at]
        return self._pending

    def flush(self) -> None:
        """Read and write everything pending (one sync; with ``all_ranks``, one all-reduce on every rank)."""
        if not self.enabled:
            return
        self._flush(block=True)
        if self._writes():
            for sink in self.sinks:
                sink.flush()

    def _reduce_and_write(self) -> None:
        """One all-reduce of every pending record's values, then the means are written (rank 0)."""
        pending = [_as_record(item) for item in self._pending]
        for record in pending:
            record.settle()
        # a rank that logged other rows fails here, and every rank with it, before the all-reduce
        arrive("MetricLogger.flush", token=_layout(pending))
        if not pending:  # every rank has nothing pending (they agreed above): no collective, no row
            return
        dist = torch.distributed
        device = env.comm_device()  # this rank's GPU under NCCL, whatever the current device is
        self._pending = []
        parts = []
        for record in pending:
            parts.append(torch.tensor(record.numbers(), dtype=torch.float64, device=device))
            if record.flat is not None:
                parts.append(record.flat.to(device, torch.float64))
        summed = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        dist.all_reduce(summed)  # collective: every rank flushes, with the same records
        values = summed.tolist()  # the one host-device sync of a flush
        world, at, rows = dist.get_world_size(), 0, []
        for record in pending:
            host = len(record.row) + 2 * len(record.pairs or ())
            end = at + record.width()
            rows.append((record.step, record.values(values[at + host : end], values[at : at + host], world)))
            at = end
        if self._writes():
            self._emit(rows)

    def close(self) -> None:
        """Flush, then close every sink; later calls do nothing (and :meth:`log` raises)."""
        if self._closed or not self.enabled:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._writes():  # every sink is closed, even after one fails
                _on_every_sink(
                    self.sinks,
                    lambda sink: sink.close(),
                    "MetricLogger.close(): the {name} sink failed to close ({error}); the other sinks were "
                    "closed.",
                )

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the block's own error wins: a sink's failure at exit does not replace it
            self.close()
        except Exception as err:
            warnings.warn(
                f"MetricLogger: closing after an error failed too: {err}", SpeedupsWarning, stacklevel=2
            )

    # ------------------------------------------------------------------------------------ host values
    def postfix(self, digits: int = 4) -> dict[str, str]:
        """The latest values, formatted for ``tqdm``'s ``set_postfix``: host values only, never a read.

        The last written values, updated by the host values (numbers, CPU tensors) logged since; a device
        value shows once its copy has landed. With ``all_ranks``, only the written (global) values.
        """
        validate.integer(digits, "digits", minimum=1, example="4")
        latest = dict(self._latest)
        if not self.all_ranks:
            for record in map(_as_record, self._pending):
                latest.update(record.row)
                for name, total, count in record.pairs or ():
                    latest[name] = _ratio(total, count)
        return {name: f"{value:.{digits}g}" for name, value in latest.items()}

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The logger's position: the last step logged and how many rows it has, after a flush (so the
        files hold them).

        A resumed run's :meth:`load_state_dict` makes the sinks keep what was written up to that step (at
        that step, the rows logged before the save: a checkpoint saved mid-window) and append after it:
        every row once, none missing, none twice. A sync and, with ``all_ranks``, a collective (the flush).
        """
        self.flush()
        rows = self._rows_at_step if self._row_step is not None and self._row_step == self._last_step else 0
        return {"step": self._last_step, "rows_at_step": rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the saved step (see :meth:`state_dict`); the sinks drop rows written after it.

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns (nothing changed).
        """
        self._check_state(state)
        rows = state.get("rows_at_step")  # absent in older checkpoints: every row at the step is kept
        self._last_step = state["step"]
        self._floor = 0 if state["step"] is None else state["step"]
        self._row_step, self._rows_at_step = state["step"], rows or 0
        self._pending, self._in_flight = [], []
        for sink in self.sinks:  # saved before any log (step None): the killed run's rows all came after
            sink.resume_rows(-1 if state["step"] is None else state["step"], rows)

    def _merge_rank_states(self, states: list[Any], change: Any) -> dict[str, Any]:
        """On another number of processes: the writer's (rank 0's) position (``load_checkpoint`` calls it)."""
        self._check_state(states[0])
        return dict(states[0])

    def _check_state(self, state: Any) -> None:
        step = state.get("step", -1) if isinstance(state, Mapping) else -1
        rows = state.get("rows_at_step") if isinstance(state, Mapping) else None
        if (
            not isinstance(state, Mapping)
            or (step is not None and (type(step) is not int or step < 0))
            or (rows is not None and (type(rows) is not int or rows < 0))
        ):
            raise ValueError(
                f"MetricLogger.load_state_dict({short(state)}): expected what MetricLogger.state_dict() "
                f"returns, {{'step': int or None, 'rows_at_step': int >= 0}}."
            )

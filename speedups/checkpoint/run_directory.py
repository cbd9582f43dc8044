"""A run directory: periodic checkpoints, the last K kept, the newest complete one resumed, a clean stop.

Every long run needs the same code around its loop: save every N updates or M minutes, keep the last few
files, find the newest one on restart and skip one a crash or a full disk cut short, and stop cleanly when
the scheduler preempts the job. :class:`RunDirectory` is that code, built on ``save_checkpoint`` /
``load_checkpoint`` (per-rank state, atomic writes, optional background writes) and :class:`StopOnSignal`.
Checkpoints are ``ckpt-<n>.pt`` (a directory for FSDP2), ``n`` counting up across restarts.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch

from speedups._helpers import env, validate
from speedups._helpers.agreement import Agreement
from speedups._helpers.holds import PathHold
from speedups._helpers.validate import short
from speedups.checkpoint import background as writes
from speedups.checkpoint import file_format
from speedups.checkpoint.entries import collective, holds_fsdp, refuse_positional, split_state
from speedups.checkpoint.layout_change import LayoutError, is_step
from speedups.checkpoint.loading import load_checkpoint, load_contents
from speedups.checkpoint.saving import write_checkpoint
from speedups.checkpoint.sharded import plain_values_of_directory
from speedups.checkpoint.stop_signal import EXIT_CODE, StopOnSignal, check_stop_arguments
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["RunDirectory"]

_NAME = re.compile(r"ckpt-(\d+)(\.pt)?$")
LOCK_NAME = "run.lock"
"""The file in the run directory its writer holds (see :class:`~speedups._helpers.holds.PathHold`)."""


class RunDirectory:
    """Save a run periodically into ``path``, keep the last ``keep``, resume from the newest complete one.

    Build it on every rank, call :meth:`resume` with the run's objects once (before the loop, as
    ``load_checkpoint``), then :meth:`after_step` after every micro-step, on every rank. It saves at the
    first window boundary at or after every multiple of ``every_updates`` optimizer steps (the same
    multiples after a resume) and/or every ``every_minutes`` minutes (the clock agreed by all ranks), as
    ``ckpt-<n>.pt`` (``n`` counts the saves), keeps the ``keep`` newest (an older one is deleted only once a
    newer one is complete), and on one of ``stop_on``'s signals saves at the micro-step every rank agrees on
    (mid-window included) and exits with ``exit_code`` (see :class:`StopOnSignal`). :meth:`resume` loads the
    newest checkpoint that reads whole and can continue on this layout; a damaged or cut one is skipped
    with a warning naming it, and an empty or new directory starts the run afresh (``{}``). One writer per
    directory: :meth:`resume` takes ``path/run.lock`` for this object alone (rank 0, the one that writes)
    until :meth:`close`, and refuses a second RunDirectory on it, in this process or another (a job started
    twice); a killed run's hold goes with its process, even while loader workers it forked live.

    Sync points: per call, none but ``StopOnSignal``'s (an asynchronous all-reduce every ~0.2 s across
    ranks); a save is ``save_checkpoint``'s; :meth:`resume` gathers every rank's choice once.

    Args:
        path: the run's directory (made if missing).
        every_updates: save every this many optimizer steps (of the ``@accumulate`` step given to
            :meth:`resume`; without one, every this many calls); None: not by updates.
        every_minutes: save every this many minutes (at the next window boundary); None: not by time.
        keep: checkpoints kept (>= 1).
        stop_on: the signals that stop the run (``StopOnSignal``'s ``signals``), or None.
        requeue, exit_code: as :class:`StopOnSignal`.
        background: write checkpoints in a background thread (``save_checkpoint(background=True)``).

    Raises:
        TypeError, ValueError: a bad argument (named); ``path`` is a file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        every_updates: int | None = None,
        every_minutes: float | None = None,
        keep: int = 3,
        stop_on: Iterable[str | int] | None = ("SIGTERM", "SIGUSR1"),
        requeue: bool | Literal["auto"] = False,
        exit_code: int = EXIT_CODE,
        background: bool = False,
    ) -> None:
        said = (
            f"RunDirectory({short(path)}, every_updates={every_updates!r}, every_minutes={every_minutes!r}, "
            f"keep={keep!r}, stop_on={short(stop_on)})"
        )
        with validate.arguments(said):
            self.path = _run_path(path)
            validate.integer(every_updates, "every_updates", minimum=1, none_ok=True, example="100")
            if every_minutes is not None:
                validate.real(every_minutes, "every_minutes", positive=True, example="30")
            validate.integer(keep, "keep", minimum=1, example="3")
            validate.flag(background, "background")
        if stop_on is not None:
            check_stop_arguments(said, stop_on, requeue, exit_code, 0.2, name="stop_on")
            if threading.current_thread() is not threading.main_thread():
                raise SpeedupsError(
                    f"{said}: stopping on a signal needs handlers, which only the main thread installs. "
                    f"Build "
                    f"the RunDirectory in the main thread, or pass stop_on=None."
                )
        else:
            check_stop_arguments(said, ["SIGTERM"], requeue, exit_code, 0.2)  # checked, though unused
        self.every_updates, self.keep, self.background = every_updates, keep, background
        self.every_s = None if every_minutes is None else 60.0 * float(every_minutes)
        self.stop = None if stop_on is None else StopOnSignal(stop_on, requeue=requeue, exit_code=exit_code)
        self._agreement = None if self.stop is not None or self.every_s is None else Agreement(1)
        self._objects: dict[str, Any] | None = None
        self._sharded = False  # an FSDP2 model is among the objects: checkpoints are directories
        self._step: Any = None  # the @accumulate step among the objects, if any
        self._calls = 0
        self._saved_updates = 0  # updates at the last save
        self._clock = time.monotonic()  # when the last save was made (or the run started)
        self._time_due = False  # the clock said "save" on some rank: save at the next boundary
        self._next = 0  # the number of the next checkpoint
        self.latest: Path | None = None
        """The newest complete checkpoint this run wrote or resumed from (None before)."""
        self._hold = PathHold(self.path / LOCK_NAME, functools.partial(_clash, self.path))  # rank 0's
        self._closed = False  # close() let the directory go: a later save takes it again

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, *unnamed: Any, **state: Any) -> dict[str, Any]:
        """Remember the run's objects (saved at every checkpoint) and load the newest complete checkpoint.

        Call it once, on every rank, after building everything and before the loop iterates the loader.

        Rank 0 first takes the directory for this object alone (``path/run.lock``, held until
        :meth:`close`): another writer of it is refused on every rank before anything in it changes.

        Returns:
            The plain values saved with it (``{"epoch": 3}``), or ``{}`` when there is none (a new run).

        Raises:
            SpeedupsError: another RunDirectory, in this process or another, holds the directory (the message
                names its process and the fixes); a checkpoint that reads whole does not fit the objects
                (``load_checkpoint``'s checks), or none of them can continue on this layout (the newest
                one's reason); the ranks do not find the same newest checkpoint; it was called before.
        """
        if self._objects is not None:
            raise SpeedupsError(
                f"RunDirectory({str(self.path)!r}).resume(): called a second time; it loads the newest "
                f"checkpoint over the objects once, before the loop. Make a new RunDirectory for a new run."
            )
        refuse_positional("RunDirectory.resume", unnamed)
        objects, plain = split_state("RunDirectory.resume", state)
        if plain:
            raise TypeError(
                f"RunDirectory.resume({', '.join(f'{k}=...' for k in plain)}): plain values are saved by "
                f"after_step(...) and returned here: values = run.resume(model=model, ...)."
            )
        sharded = holds_fsdp(objects)
        writes.wait()  # a write of this process in flight (another RunDirectory's) ends first
        error = self._take() if env.rank() == 0 else ""
        error = _gathered_text(error)  # every rank learns it (a rank that went on would wait for rank 0)
        if error:
            raise SpeedupsError(f"RunDirectory({str(self.path)!r}).resume(): {error}")
        try:
            self._sharded = sharded
            found = self._found()
            next_number = max(_gathered(max(found) + 1 if found else 0))  # past every name any rank sees
            values = self._load_newest(sorted(found, reverse=True), found, objects)
        except BaseException:
            self._hold.release()  # a failed resume leaves the directory free for the next try
            raise
        self._objects, self._next = objects, next_number  # only now: a failed resume leaves nothing bound
        self._step = next((o for o in objects.values() if is_step(o)), None)
        self._saved_updates = self._updates()
        self._clock = time.monotonic()
        return values

    def _take(self) -> str:
        """Rank 0: make the directory, hold it, remove what crashed writes left; what went wrong, or ''."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return (
                f"rank 0 could not make the directory ({type(err).__name__}: {err}). Pass a path in a "
                f"writable place."
            )
        try:
            self._hold.acquire()  # before anything in it changes: another writer's files stay as they are
        except SpeedupsError as err:
            return str(err)
        try:
            _remove_leftovers(self.path)
        except OSError as err:
            self._hold.release()
            return (
                f"rank 0 could not clear the directory ({type(err).__name__}: {err}). Pass a path in a "
                f"writable place."
            )
        return ""

    def _found(self) -> dict[int, Path]:
        """The checkpoints in the directory by number (``ckpt-<n>.pt`` files, ``ckpt-<n>`` directories)."""
        if not self.path.is_dir():
            return {}
        return {int(m.group(1)): p for p in self.path.iterdir() if (m := _NAME.fullmatch(p.name))}

    def _file(self, number: int) -> Path:
        return self.path / (f"ckpt-{number:06d}" if self._sharded else f"ckpt-{number:06d}.pt")

    def _load_newest(
        self, numbers: list[int], found: dict[int, Path], objects: dict[str, Any]
    ) -> dict[str, Any]:
        """Load the newest checkpoint that reads whole and can continue on this layout; ``{}`` if none.

        Every rank tries the same files in the same order (the checks are the same everywhere), and the ranks
        then compare what they loaded (one all-gather).

        Raises:
            SpeedupsError: a checkpoint that reads whole does not fit the objects; the ranks loaded different
                checkpoints (the directory is not one filesystem every rank sees).
        """
        chosen, values, misfit = None, {}, None
        for number in numbers:
            path = found[number]
            said = f"load_checkpoint({str(path)!r})"
            try:  # what cannot be read whole is skipped ...
                contents = None if path.is_dir() else file_format.read(path, said)
                if contents is None:  # FSDP2: complete once renamed into place
                    plain_values_of_directory(path)
            except (SpeedupsError, OSError) as err:
                self._skip(path, f"it cannot be read whole ({err})")
                continue
            try:  # ... and so is what cannot continue on this layout; a checkpoint that does not fit raises
                if contents is None:
                    values = load_checkpoint(path, **objects)  # collective: every rank reaches it alike
                else:
                    values = load_contents(said, contents, objects, depth=3)
            except LayoutError as err:
                misfit = misfit or err
                self._skip(path, f"it cannot continue on this layout ({str(err).rstrip('.')})")
                continue
            chosen = number
            break
        if chosen is None and misfit is not None:  # not a new run: this run's layout fits none of them
            raise SpeedupsError(
                f"RunDirectory({str(self.path)!r}).resume(): none of its checkpoints can continue on this "
                f"layout; the newest says: {misfit}"
            ) from misfit
        every = _gathered(-1 if chosen is None else chosen)
        if len(set(every)) > 1:
            raise SpeedupsError(
                f"RunDirectory({str(self.path)!r}).resume: the ranks resumed from different checkpoints "
                f"({dict(enumerate(every))}, -1: none): the directory must be one filesystem every rank sees."
            )
        if chosen is not None:
            self.latest = found[chosen]
        return values

    def _skip(self, path: Path, why: str) -> None:
        if env.rank() == 0:
            warnings.warn(
                f"RunDirectory.resume: skipped {str(path)!r}: {why}; trying the checkpoint before it.",
                SpeedupsWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------------------------------- steps
    def after_step(self, **values: Any) -> None:
        """Call after every micro-step, on every rank: save when due; on a stop signal, save and exit.

        ``values`` are plain values saved with the checkpoint and returned by :meth:`resume` (``epoch=3``).

        Raises:
            SpeedupsError: :meth:`resume` was not called first; a save failed (on every rank).
            SystemExit: after the stop's checkpoint (``exit_code``).
        """
        if self._objects is None:
            raise SpeedupsError(
                "RunDirectory.after_step(): call run.resume(model=..., optimizer=..., ...) first, once, "
                "before the loop: it names the objects every checkpoint saves."
            )
        if not self._calls:  # the values' names and kinds, once: a mistake shows now, not at the first save
            self._plain("RunDirectory.after_step", values)
        self._calls += 1
        clock = self.every_s is not None and time.monotonic() - self._clock >= self.every_s
        if self.stop is not None:
            stop, agreed = self.stop.check(clock)
            if stop:
                self.save(**values)
                try:
                    self.stop.exit()  # waits for the writes first
                finally:
                    self._hold.release()  # the run is over (in a process that goes on, too)
                    self._closed = True
        else:
            agreed = False
            if self._agreement is not None:
                flags = self._agreement.poll((1.0 if clock else 0.0,))
                agreed = flags is not None and flags[0] > 0
        self._time_due = self._time_due or agreed
        due = self._time_due or (  # at every multiple of N updates (a resumed run keeps the same ones)
            self.every_updates is not None
            and self._updates() // self.every_updates > self._saved_updates // self.every_updates
        )
        if due and (self._step is None or self._step.pending == 0):  # saves wait for a window boundary
            self.save(**values)

    def save(self, **values: Any) -> Path:
        """Save a checkpoint now (every rank; ``save_checkpoint``'s sync points); return its path.

        The oldest checkpoints beyond ``keep`` are deleted once this one is complete. After :meth:`close`,
        the directory is taken again first, and numbered after what is there now (one gather).

        Raises:
            SpeedupsError: :meth:`resume` was not called first; after :meth:`close`, another RunDirectory
                holds the directory; a write failed.
        """
        if self._objects is None:
            raise SpeedupsError("RunDirectory.save(): call run.resume(...) first, once, before the loop.")
        plain = self._plain("RunDirectory.save", values)
        if self._closed:
            self._reopen()
        number, self._next = self._next, self._next + 1
        path = self._file(number)
        keep_from = number - self.keep + 1
        write_checkpoint(
            path, self._objects, plain, background=self.background, then=lambda: self._prune(keep_from)
        )
        self.latest = path
        self._saved_updates = self._updates()
        self._clock = time.monotonic()
        self._time_due = False
        return path

    def _reopen(self) -> None:
        """A save after :meth:`close`: take the directory again (rank 0; another writer refused on every
        rank) and number the next checkpoint after every one there now (another run may have saved since).

        Raises:
            SpeedupsError: another RunDirectory holds the directory now (the message names it).
        """
        error = self._take() if env.rank() == 0 else ""
        error = _gathered_text(error)
        if error:
            raise SpeedupsError(f"RunDirectory({str(self.path)!r}).save() after close(): {error}")
        found = self._found()
        self._next = max(self._next, *_gathered(max(found) + 1 if found else 0))
        self._closed = False

    def _plain(self, call: str, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` checked: plain data (no objects: those go to :meth:`resume`), no name of an object.

        Raises:
            TypeError: a value is not plain data, or is an object with state.
            ValueError: a name is one of the objects' (it would overwrite its state in the file).
        """
        objects, plain = split_state(call, values, allow_empty=True)
        if objects:
            raise TypeError(
                f"{call}({', '.join(f'{k}=...' for k in objects)}): objects with state are given once, to "
                f"run.resume({', '.join(f'{k}={k}' for k in objects)}, ...); {call.split('.')[-1]}() takes "
                f"plain values (epoch=3)."
            )
        taken = sorted(set(plain) & set(self._objects or {}))
        if taken:
            raise ValueError(
                f"{call}({', '.join(f'{k}=...' for k in taken)}): {taken} name objects given to resume(), "
                f"whose state the value would replace in the checkpoint. Use another name, e.g. "
                f"{taken[0]}_count=..."
            )
        return plain

    def _prune(self, keep_from: int) -> None:
        """Delete the checkpoints numbered below ``keep_from`` (rank 0, once a newer one is complete)."""
        for number, old in self._found().items():
            if number < keep_from:
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)

    def _updates(self) -> int:
        return int(self._step.num_updates) if self._step is not None else self._calls

    def close(self) -> None:
        """Wait for a background write, put back the signal handlers (the run ended without a stop) and let
        the directory go (another RunDirectory may take it)."""
        writes.wait()
        error = writes.take_error()
        self._hold.release()
        self._closed = True
        if self.stop is not None:
            self.stop.close()
        if self._agreement is not None:
            self._agreement.close()
        if error:
            raise SpeedupsError(f"RunDirectory.close(): the last checkpoint could not be written ({error}).")

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        if not isinstance(exc[1], SystemExit):
            self.close()

    def __repr__(self) -> str:
        return (
            f"RunDirectory({str(self.path)!r}, every_updates={self.every_updates}, keep={self.keep}, "
            f"latest={None if self.latest is None else self.latest.name!r})"
        )


_LEFTOVER = re.compile(r"\.ckpt-\d+(\.pt\.\w+\.tmp|\.partial)$")


def _run_path(path: Any) -> Path:
    """``path`` as an absolute ``Path`` (a later ``chdir`` does not move the run); ValueError/TypeError if it
    is not a directory name, or a file stands where it or a folder above it should be."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        error = ValueError if isinstance(path, str) else TypeError
        raise error(
            f"path={short(path)}: expected the run's directory, a non-empty str or Path, e.g. 'runs/exp1'."
        )
    path = Path(path).absolute()
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                where = "is a file" if place == path else f"lies under the file {str(place)!r}"
                raise ValueError(f"path={str(path)!r} {where}; pass a directory for the run.")
            break
    return path


def _clash(path: Path, holder: int | None) -> str:
    """The message when another RunDirectory holds ``path`` (``holder``: its process id, when known)."""
    if holder == os.getpid():
        who = f"another RunDirectory of this process ({holder}) writes it"
    else:
        process = "a process" if holder is None else f"process {holder}"
        who = f"another RunDirectory writes it ({process} holds {str(path / LOCK_NAME)!r})"
    return (
        f"{str(path)!r} is taken: {who}. Two writers of one run directory number their checkpoints alike and "
        f"overwrite each other's (a job started twice, a notebook cell run again while the first object "
        f"lives). Close the first (first_run.close(), or a with-block), stop the other job, or give this run "
        f"its own directory: RunDirectory({str(path.with_name(path.name + '-2'))!r}, ...)."
    )


def _remove_leftovers(path: Path) -> None:
    """Temporary files of writes a crash cut short (``save_checkpoint`` renames only complete ones)."""
    for p in path.iterdir():
        if _LEFTOVER.fullmatch(p.name):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _gathered_text(text: str) -> str:
    """Rank 0's ``text`` on every rank (one broadcast; ``text`` in one process)."""
    if not collective():
        return text
    box = [text]
    with env.on_comm_device():
        torch.distributed.broadcast_object_list(box, src=0)
    return str(box[0])


def _gathered(value: int) -> list[int]:
    """Every rank's ``value`` (one all-gather; ``[value]`` in one process)."""
    if not collective():
        return [value]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    with env.on_comm_device():
        torch.distributed.all_gather_object(every, value)
    return every

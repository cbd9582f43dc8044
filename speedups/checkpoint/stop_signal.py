"""Preemption: stop a run cleanly on a signal, at a micro-step every rank agrees on, then exit.

SLURM and torchrun send SIGTERM (or ``--signal=USR1@90``) to every process of a job before they kill it; a
hand-written flag fails there: the loader workers die of the signal first, and each rank sees it at another
micro-step. :class:`StopOnSignal` records the signal in a handler (nothing else runs in it), keeps loader
workers of ``fast_loader``/``distributed()`` alive (they ignore the signals, see
:mod:`speedups.data.workers`), agrees on the micro-step to stop after through
:class:`~speedups._helpers.agreement.Agreement` (an asynchronous all-reduce every ~0.5 s, never a blocking
collective per call), and after the checkpoint :meth:`StopOnSignal.exit` waits for background writes,
requeues the SLURM job if asked, ends the process group and exits with :data:`EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any, Literal, NoReturn

import torch

from speedups._helpers import env, validate
from speedups._helpers.agreement import Agreement
from speedups._helpers.arrival import arrive
from speedups._helpers.validate import short
from speedups.checkpoint import background as writes
from speedups.data import workers
from speedups.errors import SpeedupsError

__all__ = ["EXIT_CODE", "STOPPING_SIGNALS", "StopOnSignal", "check_stop_arguments"]

EXIT_CODE = 75
"""The exit status after a clean stop: ``EX_TEMPFAIL`` of ``sysexits.h``, "try again later" (the checkpoint
is saved; run the same command to resume). Not 0, so a scheduler or wrapper script can tell it from a run
that finished, and not 128 + the signal, which a shell shows for a process the signal killed."""

STOPPING_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")
"""The signals a scheduler sends to ask a job to end (SLURM, torchrun, Kubernetes: SIGTERM; ``--signal``: any;
SIGXCPU: a CPU-time limit). Others (faults such as SIGSEGV, SIGCHLD, SIGPIPE, SIGALRM, Ctrl-C's SIGINT,
SIGKILL) are refused: catching them would hang or stop the run for the wrong reason."""

# One handler per signal serves every live StopOnSignal that watches it (a RunDirectory's and a user's own):
# each is told; the handler there before the first comes back when the last one closes.
_watchers: dict[int, list[StopOnSignal]] = {}
_before: dict[int, Any] = {}


def _dispatch(signum: int, frame: FrameType | None) -> None:
    for watcher in list(_watchers.get(signum, ())):
        watcher._tell(signum)


def _signal_number(value: Any, argument: str) -> int:
    """A signal given by name (``"SIGTERM"``, ``"TERM"``), number or ``signal.Signals``, as its number."""
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        number = getattr(signal, name, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(
                f"{argument}: {value!r} is no signal of this platform; e.g. 'SIGTERM', 'SIGUSR1'."
            )
        value = number
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{argument}: signals are names ('SIGTERM'), numbers or signal.Signals; got {short(value)}."
        )
    try:
        sig = signal.Signals(value)
    except ValueError:
        raise ValueError(f"{argument}: {value!r} is not a signal number of this platform.") from None
    if sig.name not in STOPPING_SIGNALS:
        raise ValueError(
            f"{argument}: {sig.name} is not a signal that asks a job to stop (catching it would hang on a "
            f"fault or stop "
            f"for the wrong reason). Allowed: {', '.join(STOPPING_SIGNALS)}."
        )
    return int(sig)


class StopOnSignal:
    """Stop a run cleanly on SIGTERM or SIGUSR1 (configurable): the same micro-step on every rank, then exit.

    Call :meth:`requested` once per micro-step, on every rank; it turns True on the same call on every rank
    once any process of the job got one of the ``signals`` (SLURM and torchrun signal every process; one
    rank's signal is enough). Save the checkpoint there (``save_checkpoint`` saves mid-window too; for an
    FSDP2 model, the window's pending calls, made again on resume), then call :meth:`exit`.
    Loader workers of ``fast_loader``/``distributed()`` ignore these signals, so they still serve the save.
    Made on every rank, before or after the process group starts; the first :meth:`requested` makes its own
    gloo process group (a collective: every rank calls it from the first micro-step on).
    Handlers are installed in the main thread at construction; several ``StopOnSignal`` (a run directory's
    and your own) all hear a signal they watch; :meth:`close` (or leaving a ``with`` block) stops watching,
    and the handlers there before come back when none is left. Signals that arrive while already stopping
    change nothing.

    Sync points: none per call; every ~``latency`` seconds one asynchronous all-reduce of a flag (on the CPU,
    read a round later), so the stop comes about ``2 * latency`` seconds after the first signal.

    Args:
        signals: names (``"SIGTERM"``), numbers or ``signal.Signals`` of :data:`STOPPING_SIGNALS` (SIGTERM,
            SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGXCPU).
        requeue: on :meth:`exit`, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (True: a SLURM job is
            required; ``"auto"``: only under SLURM; False: never).
        exit_code: the exit status of :meth:`exit` (default :data:`EXIT_CODE`, 75).
        latency: seconds between agreement rounds (> 0).

    Raises:
        TypeError, ValueError: a bad argument (named). SpeedupsError: not in the main thread, or
            ``requeue=True`` outside a SLURM job.

    Example:
        >>> stop = StopOnSignal(["SIGUSR2"])
        >>> for micro_step in range(3):   # the training loop; train_step(x, y) here
        ...     if stop.requested():      # save_checkpoint(...), then stop.exit()
        ...         break
        >>> stop.close()
    """

    def __init__(
        self,
        signals: Iterable[str | int | signal.Signals] = ("SIGTERM", "SIGUSR1"),
        *,
        requeue: bool | Literal["auto"] = False,
        exit_code: int = EXIT_CODE,
        latency: float = 0.2,
    ) -> None:
        said = f"StopOnSignal(signals={short(signals)}, requeue={requeue!r}, exit_code={exit_code!r})"
        numbers = check_stop_arguments(said, signals, requeue, exit_code, latency)
        if threading.current_thread() is not threading.main_thread():
            raise SpeedupsError(f"{said}: signal handlers can only be installed from the main thread.")
        self.signals = [signal.Signals(n) for n in numbers]
        self.requeue = requeue
        self.exit_code = exit_code
        self.received: signal.Signals | None = None
        """The first signal this process received, or None."""
        self.stopping = False
        """Whether every rank agreed to stop (:meth:`requested` returned True)."""
        self._agreement = Agreement(2, latency)  # [a signal came, a save is due (a run directory's)]
        self._alone: bool | None = None  # this process is the whole job (decided at the first call)
        self._open = True
        for number in numbers:
            if not _watchers.get(number):
                _before[number] = signal.signal(number, _dispatch)
                workers.STOP_SIGNALS.add(number)  # loader workers started from now on ignore it too
            _watchers.setdefault(number, []).append(self)

    def _tell(self, signum: int) -> None:
        """The dispatcher's call: one of this object's signals came (main thread, between bytecodes)."""
        if self.received is None:
            self.received = signal.Signals(signum)
            sys.stderr.write(
                f"speedups: {self.received.name} received (rank {env.rank()}): stopping after the micro-step "
                f"every rank agrees on, to save a checkpoint.\n"
            )
            sys.stderr.flush()

    def requested(self) -> bool:
        """Whether to stop after this micro-step: True from the same call on every rank once any got a signal.

        Call it once per micro-step on every rank (the calls are counted to agree on one of them).
        """
        if self._alone is None:
            self._alone = self._agreement.alone
        if self._alone:
            self.stopping = self.stopping or self.received is not None
            return self.stopping
        return self.check(False)[0]

    def check(self, due: bool) -> tuple[bool, bool]:
        """:meth:`requested`, agreeing on one more flag at the same time: ``(stop, due on some rank)``.

        ``due`` is agreed like the signal (a run directory's "a save is due by the clock"); both come back
        True on the same call on every rank. Alone, both are this process's own.
        """
        if self.stopping:
            return True, due
        if self._alone is None:
            self._alone = self._agreement.alone
        if self._alone:
            self.stopping = self.received is not None
            return self.stopping, due
        agreed = self._agreement.poll((0.0 if self.received is None else 1.0, 1.0 if due else 0.0))
        if agreed is None:
            return False, False
        self.stopping = agreed[0] > 0
        return self.stopping, agreed[1] > 0

    def exit(self) -> NoReturn:
        """End this process after the checkpoint was saved: wait for background writes, requeue the SLURM job
        (rank 0, if asked), end the process group, exit with ``exit_code``. Call it on every rank, once
        :meth:`requested` returned True.

        Raises:
            SystemExit: ``exit_code``.
            SpeedupsError: no stop was agreed (the run was not preempted: exiting with "try again" and
                requeueing would run it again); a background checkpoint write failed (nothing is requeued).
        """
        if not self.stopping:
            raise SpeedupsError(
                "StopOnSignal.exit(): no stop was requested (requested() has not returned True), so exiting "
                "with status 75 ('try again') and requeueing would run the job again. End a finished run "
                "normally; call exit() after `if stop.requested(): save_checkpoint(...)`."
            )
        writes.wait()
        error = writes.take_error()
        if error:
            raise SpeedupsError(f"StopOnSignal.exit(): the last checkpoint could not be written ({error}).")
        if env.rank() == 0 and self._requeues():
            _requeue(os.environ["SLURM_JOB_ID"])
        self._agreement.close()
        if env.pg_ready():
            gc.collect()  # free DDP reducers while the process group still exists
            with contextlib.suppress(SpeedupsError):  # a rank that is gone: end this one anyway
                arrive("StopOnSignal.exit", timeout_s=20.0)  # every rank saved: none still talks to another
            torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(self.exit_code)

    def _requeues(self) -> bool:
        return bool(self.requeue) and bool(os.environ.get("SLURM_JOB_ID"))

    def close(self) -> None:
        """Stop watching (this process's loop ends without a stop): the handlers that were there before the
        first live ``StopOnSignal`` come back once none watches the signal. Closing twice is a no-op."""
        if not self._open:
            return
        self._open = False
        for sig in self.signals:
            number = int(sig)
            others = [w for w in _watchers.get(number, []) if w is not self]
            _watchers[number] = others
            if not others:
                signal.signal(number, _before.pop(number, signal.SIG_DFL))
                if sig.name not in ("SIGTERM", "SIGUSR1"):  # the two loader workers always ignore
                    workers.STOP_SIGNALS.discard(number)
        self._agreement.close()

    def __enter__(self) -> StopOnSignal:
        if not self._open:
            raise SpeedupsError(
                "StopOnSignal: this one was closed; make a new StopOnSignal(...) to watch again."
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if not isinstance(exc[1], SystemExit):  # a stop's exit keeps the handlers to the end
            self.close()

    def __repr__(self) -> str:
        names = [s.name for s in self.signals]
        return (
            f"StopOnSignal({names}, requeue={self.requeue!r}, received={self.received}, "
            f"stopping={self.stopping})"
        )


def check_stop_arguments(
    said: str, signals: Any, requeue: Any, exit_code: Any, latency: Any, name: str = "signals"
) -> list[int]:
    """Check :class:`StopOnSignal`'s arguments (``RunDirectory`` checks its own with it, the signals being its
    ``name="stop_on"``); return the signal numbers, sorted.

    Raises:
        TypeError, ValueError: a bad argument (named); SpeedupsError: ``requeue=True`` outside SLURM.
    """
    if isinstance(signals, (str, int)):
        signals = [signals]
    with validate.arguments(said):
        if isinstance(signals, bytes) or not hasattr(signals, "__iter__"):
            raise TypeError(
                f"{name}={short(signals)}: expected a list of signal names or numbers, e.g. "
                f"['SIGTERM', 'SIGUSR1']."
            )
        numbers = sorted({_signal_number(s, name) for s in signals})
        if not numbers:
            raise ValueError(f"{name}=[]: give at least one signal, e.g. ['SIGTERM', 'SIGUSR1'].")
        if requeue != "auto" and not isinstance(requeue, bool):
            raise TypeError(
                f"requeue={short(requeue)}: expected True (requeue this SLURM job), 'auto' (only under "
                f"SLURM) "
                f"or False."
            )
        validate.integer(exit_code, "exit_code", minimum=0, maximum=255, example="75")
        validate.real(latency, "latency", positive=True, example="0.2 (seconds)")
    if requeue is True and not os.environ.get("SLURM_JOB_ID"):
        raise SpeedupsError(
            f"{said}: requeue=True asks SLURM to requeue this job, but SLURM_JOB_ID is not set (not a SLURM "
            f"job). Pass requeue='auto' to requeue only under SLURM, or requeue=False."
        )
    return numbers


def _requeue(job: str) -> None:
    """``scontrol requeue JOB``; a failure is said on stderr (the checkpoint is saved either way)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        sys.stderr.write(f"speedups: cannot requeue SLURM job {job}: scontrol is not on PATH.\n")
        return
    try:
        done = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        sys.stderr.write(f"speedups: `scontrol requeue {job}` failed: {err}\n")
        return
    if done.returncode:
        sys.stderr.write(
            f"speedups: `scontrol requeue {job}` failed ({done.returncode}): {done.stderr.strip()}\n"
        )
    else:
        sys.stderr.write(f"speedups: SLURM job {job} requeued.\n")

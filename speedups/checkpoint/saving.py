"""Checkpoints that survive a crash: every rank's state in one file, written atomically by rank 0.

``save_checkpoint(path, model=..., optimizer=..., loader=...)`` stores the ``state_dict()`` of every object
passed by name (a model's plain keys, whatever wraps it), plain values (``step=120``) and the RNG states of
every rank, as a plain dict (layout in :mod:`speedups.checkpoint.file_format`). Rank 0 writes a temporary
file next to ``path`` and renames it over ``path`` (atomic); the other ranks wait until the file is complete.
FSDP2 models go through ``torch.distributed.checkpoint`` (:mod:`speedups.checkpoint.sharded`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups._helpers.rng import get_rng_states
from speedups.checkpoint import background as writes
from speedups.checkpoint import file_format
from speedups.checkpoint.entries import (
    check_path,
    collective,
    holds_fsdp,
    refuse_positional,
    saved_object,
    split_state,
)
from speedups.checkpoint.rank_states import gather_rank_states, is_per_rank
from speedups.checkpoint.sharded import save_sharded
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["ALONE_AFTER_S", "save_checkpoint", "write_checkpoint"]

ALONE_AFTER_S = 5.0
"""Seconds rank 0 waits for the other ranks in ``save_checkpoint`` before it saves alone."""


def save_checkpoint(
    path: str | os.PathLike[str], *unnamed: Any, background: bool = False, **state: Any
) -> Path:
    """Save every named object's ``state_dict()``, plain values and every rank's RNG states to ``path``.

    Call it on **every rank** at the same point (it runs collectives: some ``state_dict()`` calls, the
    gather of every rank's RNG states and per-rank objects' states, and a final wait); each rank gets its own
    back from :func:`~speedups.load_checkpoint` (an ``@accumulate`` step saved mid-window holds each rank's
    own pending gradients). Rank 0 alone writes, to a temporary name in the same directory, flushed to
    disk, then renamed over ``path`` (atomic: a crash mid-write never leaves a broken checkpoint). Called on
    rank 0 alone (a port of ``if master_process: torch.save(...)``), it waits :data:`ALONE_AFTER_S` seconds
    for the others, then saves what rank 0 holds (a DDP model and a non-sharded optimizer are the same on
    every rank), without the other ranks' RNG states, with one warning; sharded FSDP2 state or a window in
    progress is refused then. The mode
    follows the umask, as with ``torch.save``. A model is saved without wrapper prefixes (DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``), so it loads into the plain or any wrapped model. The file is a
    plain dict (``torch.load(path, weights_only=True)`` reads it without speedups): ``{name: state_dict or
    value, ..., "_speedups": {format, world size, class names, RNG states}}``. A
    :class:`~speedups.DistributedLoader` saves its epoch and position, so a resumed run continues with the
    next batch. With an FSDP2 model, ``path`` is a directory written by ``torch.distributed.checkpoint``
    (each rank its shards), complete or absent as a file is; an ``@accumulate`` step saved mid-window holds
    the window's pending calls instead of gradients (FSDP2's are unreadable), which it makes again after
    loading (see :mod:`speedups.accumulation.replay`).

    ``background=True`` returns once rank 0 holds a copy of the state in host memory (memory: one more copy
    of what is saved) and writes the file in a thread: the loop stalls for the copy only, the previous file
    stays intact until the new one is complete, and the next save or load waits for the write (as does the
    interpreter at exit); a failed write is raised by the next ``save_checkpoint``, on every rank. With an
    FSDP2 model it is ``torch.distributed.checkpoint.async_save``: DCP copies each rank's shards to host
    memory, writes them in its own thread (its collectives on a gloo group of their own), and rank 0 renames
    the directory into place once every rank's part is written.

    Sync points: the ``state_dict()`` calls (a device-to-host copy for some), a ``gather_object`` of the
    per-rank states and a broadcast from rank 0 after the write (with ``background``, after the copy).

    Args:
        path: the checkpoint file (its directory is created), or directory for FSDP2.
        background: write the file in a background thread (FSDP2: DCP's ``async_save``).
        **state: objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler, loader,
            LossTracker, @accumulate step, mixed_precision) and plain values (``step=120``), by the names
            used to load them.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: a value is neither stateful nor plain data; an object given by position (it needs a name).
        ValueError: nothing passed, or a name starts with ``_``.
        SpeedupsError: rank 0 could not write the file (or the background write before failed), or
            ``path`` is a directory (raised on every rank);
            rank 0 alone with FSDP2 or a window in progress; a rank other than 0 alone, at the collective
            timeout (it says after 10 s, on stderr, that every rank must call it).

    Example:
        >>> import tempfile, os
        >>> from torch import nn
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = save_checkpoint(path, model=nn.Linear(2, 1), step=3)
        >>> sorted(torch.load(path, weights_only=True))    # plain entries, readable without speedups
        ['_speedups', 'model', 'step']
        >>> from speedups import load_checkpoint
        >>> load_checkpoint(path, model=nn.Linear(2, 1))
        {'step': 3}
    """
    path = check_path("save_checkpoint", path)
    refuse_positional("save_checkpoint", unnamed)
    with validate.arguments(f"save_checkpoint(path, background={background!r})"):
        validate.flag(background, "background")
    objects, plain = split_state("save_checkpoint", state)
    return write_checkpoint(path, objects, plain, background=background)


def write_checkpoint(
    path: Path,
    objects: dict[str, Any],
    plain: dict[str, Any],
    *,
    background: bool = False,
    then: Callable[[], None] | None = None,
) -> Path:
    """:func:`save_checkpoint` of checked arguments; ``then`` runs on rank 0 once the file is complete (in
    the writer thread with ``background``), as a run directory drops its oldest checkpoints then."""
    sharded = holds_fsdp(objects)
    together = arrive("save_checkpoint", alone_after_s=ALONE_AFTER_S) if collective() else True
    if not together:
        if env.rank() != 0:
            return path  # rank 0 went on alone and wrote the file; this rank arrived too late to join
        _check_alone(path, objects, sharded)
    if sharded:
        writes.wait()
        save_sharded(path, objects, plain, background=background, then=then)
        return path
    targets = {name: saved_object(obj) for name, obj in objects.items()}
    payload: dict[str, Any] = {name: target.state_dict() for name, target in targets.items()}
    payload.update(plain)
    meta: dict[str, Any] = {
        "format": file_format.FORMAT,
        "world_size": env.world_size(),
        "objects": {name: type(target).__name__ for name, target in targets.items()},
    }
    if together:  # every rank's RNG states and per-rank objects' states, to rank 0 (a collective)
        own = {name: payload[name] for name, target in targets.items() if is_per_rank(target)}
        gathered = gather_rank_states(own)
        if gathered is not None:
            meta["rng"], per_rank = gathered
            if per_rank:
                meta["per_rank"] = per_rank
    else:
        meta["rng"], meta["rng_ranks"] = [file_format.rng_to_file(get_rng_states())], [0]
    payload[file_format.META] = meta
    errors = ["", ""]  # [this save's, the background write before's]
    if env.rank() == 0:
        writes.wait()  # the write in flight ends first (its buffers take this copy; it may be this path)
        errors[1] = writes.take_error()
        if path.is_dir():
            errors[0] = f"IsADirectoryError: {path} is a directory; pass a file name, e.g. {path / 'ckpt.pt'}"
        elif background:
            writes.start(path, writes.host_copy(payload), then)
        else:
            try:
                file_format.write(path, payload)
                if then is not None:
                    then()
            except OSError as err:
                errors[0] = f"{type(err).__name__}: {err}"
    if collective() and together:
        with env.on_comm_device():  # this rank's GPU under NCCL, not whatever is current
            torch.distributed.broadcast_object_list(errors, src=0)  # also the barrier: the file is complete
    if errors[0]:
        raise SpeedupsError(
            f"save_checkpoint({str(path)!r}): rank 0 could not write the checkpoint ({errors[0]})"
            + (f"; the background write before failed too ({errors[1]})" if errors[1] else "")
            + ". Check that the path is a file name in a writable directory with space."
        )
    if errors[1]:
        raise SpeedupsError(
            f"save_checkpoint({str(path)!r}): the checkpoint before, written in the background, failed "
            f"({errors[1]}); this one was {'handed to the writer' if background else 'written'}. Save "
            f"again if that one mattered."
        )
    return path


def _check_alone(path: Path, objects: dict[str, Any], sharded: bool) -> None:
    """Rank 0 saves alone: refuse what only every rank together holds; say once what the file lacks.

    Raises:
        SpeedupsError: sharded FSDP2 state, or an ``@accumulate`` step in the middle of a window (each rank's
            pending gradients differ), which rank 0 alone cannot save.
    """
    said = f"save_checkpoint({str(path)!r}) on rank 0 alone (no other rank came within {ALONE_AFTER_S:g} s)"
    fix = "Call save_checkpoint on every rank (it still writes once, from rank 0)"
    if sharded:
        raise SpeedupsError(f"{said}: an FSDP2 model's state is sharded across the ranks. {fix}.")
    pending = [name for name, obj in objects.items() if getattr(obj, "pending", 0)]
    if pending:
        raise SpeedupsError(
            f"{said}: {pending} hold an open accumulation window whose gradients differ per rank. {fix}, or "
            f"save at a boundary (train_step.pending == 0)."
        )
    warnings.warn(
        f"{said}: saved what rank 0 holds (a DDP model and an optimizer are the same on every rank); the "
        f"other ranks' RNG states are not in the file, and per-rank values (a LossTracker, a loader's rank) "
        f"are rank 0's. {fix} to resume every rank exactly.",
        SpeedupsWarning,
        stacklevel=3,
    )

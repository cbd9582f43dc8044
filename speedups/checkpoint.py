"""Checkpoints that survive a crash, resume a run bit for bit, and load into any wrapper of the model.

``save_checkpoint(path, model=..., optimizer=..., loader=...)`` stores the ``state_dict()`` of every object
passed by name (a model's plain keys, whatever wraps it), plain values (``step=120``) and the RNG states of
every rank, as a plain dict (layout in :mod:`speedups._checkpoint_file`). Rank 0 writes a temporary file
next to ``path`` and renames it over ``path`` (atomic); the other ranks wait until the file is complete.
``load_checkpoint(path, model=..., optimizer=..., loader=...)`` checks every entry first
(:mod:`speedups._checkpoint_checks`) and only then loads; it also loads foreign ``torch.save`` dicts
(``keys={"model": "state_dict"}``). FSDP2 models go through ``torch.distributed.checkpoint`` (a directory
of shards, each rank writes its own).
"""

from __future__ import annotations

import copy
import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from speedups import _checkpoint_file, _env
from speedups._checkpoint_checks import check_entry, is_checked
from speedups._rng import get_rng_states, set_rng_states
from speedups._step_checks import short
from speedups._wrappers import unwrap
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["load_checkpoint", "save_checkpoint"]

_PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def _pg() -> bool:
    return _env.pg_ready() and torch.distributed.get_world_size() > 1


def _fsdp_type() -> type | None:
    return getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _split(
    call: str, state: Mapping[str, Any], *, allow_empty: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    objects, plain = {}, {}
    for name, value in state.items():
        if name.startswith("_"):
            raise ValueError(f"{call}({name}=...): names starting with '_' are reserved. Rename it.")
        if _is_stateful(value):
            objects[name] = value
        elif _is_plain(value):
            plain[name] = value
        else:
            fix = f"Pass its state as a plain value instead, e.g. {name}={name}.get_state() for a Generator."
            if isinstance(value, DataLoader):
                fix = (
                    f"A plain DataLoader has no state (no position to resume from): build it once, before "
                    f"the loop, as {name} = distributed({name}, seed=0) (it works in one process too; its "
                    f"shuffle comes from seed + epoch), iterate that, and pass it."
                )
            raise TypeError(
                f"{call}({name}={type(value).__name__}): expected an object with state_dict() and "
                f"load_state_dict() (model, optimizer, scheduler, DistributedLoader, LossTracker, ...) or a "
                f"plain value (number, string, tensor, list/dict of them). {fix}"
            )
    if not state and not allow_empty:
        raise ValueError(f"{call}(path): nothing to save or load. Pass objects by name, e.g. model=model.")
    return objects, plain


def _check_path(call: str, path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        error = ValueError if isinstance(path, str) else TypeError
        raise error(
            f"{call}(path={short(path)}): expected the checkpoint's file name, a non-empty str or "
            f"pathlib.Path. Write {call}('checkpoints/last.pt', ...)."
        )
    return Path(path)


def _unwrap(obj: Any) -> Any:
    """The object whose state is saved: a model without its DDP / DataParallel / torch.compile wrappers."""
    return unwrap(obj) if isinstance(obj, nn.Module) else obj


def _gather_rng() -> list[dict[str, Any]]:
    mine = _checkpoint_file.rng_to_file(get_rng_states())
    if not _pg():
        return [mine]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)  # collective: checkpoints are saved by every rank
    return every


def save_checkpoint(path: str | os.PathLike[str], **state: Any) -> Path:
    """Save every named object's ``state_dict()``, plain values and every rank's RNG states to ``path``.

    Call it on **every rank** at the same point (it runs collectives: some ``state_dict()`` calls, the RNG
    gather, and a final wait); rank 0 alone writes, to a temporary name in the same directory, flushed to
    disk, then renamed over ``path`` (atomic: a crash mid-write never leaves a broken checkpoint). The mode
    follows the umask, as with ``torch.save``. A model is saved without wrapper prefixes (DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``), so it loads into the plain or any wrapped model. The file is a
    plain dict (``torch.load(path, weights_only=True)`` reads it without speedups): ``{name: state_dict or
    value, ..., "_speedups": {format, world size, class names, RNG states}}``. A
    :class:`~speedups.DistributedLoader` saves its epoch and position, so a resumed run continues with the
    next batch. With an FSDP2 model, ``path`` is a directory written by ``torch.distributed.checkpoint``.

    Sync points: the ``state_dict()`` calls (a device-to-host copy for some), an ``all_gather_object`` of the
    RNG states and a broadcast from rank 0 after the write.

    Args:
        path: the checkpoint file (its directory is created), or directory for FSDP2.
        **state: objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler, loader,
            LossTracker, @accumulate step, mixed_precision) and plain values (``step=120``), by the names
            used to load them.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: a value is neither stateful nor plain data.
        ValueError: nothing passed, or a name starts with ``_``.
        SpeedupsError: rank 0 could not write the file, or ``path`` is a directory (raised on every rank).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = save_checkpoint(path, model=nn.Linear(2, 1), step=3)
        >>> sorted(torch.load(path, weights_only=True))    # plain entries, readable without speedups
        ['_speedups', 'model', 'step']
        >>> load_checkpoint(path, model=nn.Linear(2, 1))
        {'step': 3}
    """
    path = _check_path("save_checkpoint", path)
    objects, plain = _split("save_checkpoint", state)
    fsdp = _fsdp_type()
    if fsdp is not None and any(isinstance(o, fsdp) for o in objects.values()):
        _save_dcp(path, objects, plain)
        return path
    targets = {name: _unwrap(obj) for name, obj in objects.items()}
    payload: dict[str, Any] = {name: target.state_dict() for name, target in targets.items()}
    payload.update(plain)
    payload[_checkpoint_file.META] = {
        "format": _checkpoint_file.FORMAT,
        "world_size": _env.world_size(),
        "objects": {name: type(target).__name__ for name, target in targets.items()},
        "rng": _gather_rng(),
    }
    error = ""
    if _env.rank() == 0:
        try:
            _checkpoint_file.write(path, payload)
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
    if _pg():
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)  # also the barrier: the file is complete now
        error = box[0]
    if error:
        raise SpeedupsError(
            f"save_checkpoint({str(path)!r}): rank 0 could not write the checkpoint ({error}). "
            f"Check that the path is a file name in a writable directory with space."
        )
    return path


def load_checkpoint(
    path: str | os.PathLike[str], *, keys: Mapping[str, str] | None = None, **state: Any
) -> dict[str, Any]:
    """Load a checkpoint into the named objects, after checking every entry; return its plain values.

    **Where to call it:** after building the model, optimizer, scheduler, loader and ``@accumulate`` step,
    and *before* the loop starts iterating the loader (before ``iter(loader)``, ``for batch in loader`` or
    ``train_step.epoch(loader)``). Then the resumed run equals the uninterrupted one bit for bit: weights,
    optimizer, loss scale, tracker and the batch order, with every RNG restored at the point it was saved
    (a loader still being iterated is refused with a SpeedupsError that says so).

    Before any object changes it checks: every name was saved; a model's keys and shapes (wrapper prefixes
    removed on both sides, so DDP / ``torch.compile`` / plain load into each other); an optimizer's class,
    its groups' hyperparameter keys and sizes and its state's shapes; a scheduler's class and keys; and that
    every speedups object accepts its entry. Other objects load first and are put back if one fails.

    A foreign file (any ``torch.save`` dict) loads too: ``keys`` maps argument names to its entries, e.g.
    ``load_checkpoint(path, model=m, optimizer=o, keys={"model": "state_dict"})`` returns its other entries
    (``{"epoch": 3, ...}``); no RNG state is restored from it. Every rank passes the same ``path``.

    Sync points: none beyond the copies ``load_state_dict`` makes to each parameter's device; no
    collective (FSDP2 through ``torch.distributed.checkpoint``, which is collective).

    Args:
        path: the file (or FSDP2 directory) to read.
        keys: argument name -> the file's entry, where they differ (``{"model": "state_dict"}``).
        **state: the objects to restore, by name (a subset of what was saved is fine).

    Returns:
        The plain values saved (``{"epoch": 3}``); for a foreign file, every entry not loaded.

    Raises:
        FileNotFoundError: no file at ``path``.
        TypeError, ValueError: a value has no ``load_state_dict``; ``keys`` is not a dict of names, or
            names an object not passed; an entry a speedups object refuses.
        SpeedupsError: the file is a directory, empty, truncated, damaged or not a dict (the message names
            it); an entry is missing; a model, optimizer or scheduler does not match it. Nothing has
            changed when it raises.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "theirs.pt")
        >>> net = torch.nn.Linear(2, 1)
        >>> torch.save({"epoch": 3, "state_dict": net.state_dict()}, path)    # a foreign layout
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 1), keys={"model": "state_dict"})
        {'epoch': 3}
    """
    objects, extra = _split("load_checkpoint", state, allow_empty=True)
    if extra:
        raise TypeError(
            f"load_checkpoint({', '.join(f'{k}=...' for k in extra)}): plain values cannot be loaded into; "
            f"they are returned: values = load_checkpoint(path, model=model)."
        )
    entry_of = _check_keys(keys, objects)
    path = _check_path("load_checkpoint", path)
    said = f"load_checkpoint({str(path)!r})"
    fsdp = _fsdp_type()
    if fsdp is not None and any(isinstance(o, fsdp) for o in objects.values()):
        if keys:
            raise ValueError(f"{said}: keys= maps entries of a checkpoint file, not of an FSDP2 directory.")
        return _load_dcp(path, objects)
    contents = _checkpoint_file.read(path, said)
    entries = contents.entries
    missing = [name for name in objects if entry_of[name] not in entries]
    if missing:
        raise SpeedupsError(_missing(said, missing, entry_of, contents))
    classes = contents.objects or {}
    ready = {
        name: check_entry(said, name, entry_of[name], _unwrap(obj), entries[entry_of[name]],
                          classes.get(entry_of[name]))
        for name, obj in objects.items()
    }  # fmt: skip
    rng = _rng_of_this_rank(contents.rng, said)  # checked before any object changes
    _load_all(objects, ready)
    if rng is not None:
        set_rng_states(rng)
    used = set(entry_of.values())
    if contents.foreign:
        return {k: v for k, v in entries.items() if k not in used}
    return {k: v for k, v in entries.items() if k not in classes and k not in used}


def _check_keys(keys: Any, objects: dict[str, Any]) -> dict[str, str]:
    """Validate ``keys=``; return the file's entry for every object passed."""
    if keys is None:
        return {name: name for name in objects}
    said = f"load_checkpoint(path, keys={keys!r})"
    if not isinstance(keys, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in keys.items()
    ):
        raise TypeError(
            f"{said}: expected a dict of argument name -> entry name, e.g. keys={{'model': 'state_dict'}}."
        )
    unknown = sorted(set(keys) - set(objects))
    if unknown:
        raise ValueError(
            f"{said}: {unknown} name no object passed to load_checkpoint (passed: {sorted(objects)}). "
            f"Pass the object too: load_checkpoint(path, {unknown[0]}=..., keys=...)."
        )
    return {name: keys.get(name, name) for name in objects}


def _missing(said: str, missing: list[str], entry_of: dict[str, str], contents: Any) -> str:
    held = sorted(contents.entries)
    absent = [entry_of[n] for n in missing]
    if not contents.foreign:
        return f"{said}: {absent} were not saved; it holds {held}."
    example = ", ".join(f"{n!r}: '...'" for n in missing)
    hint = ""
    if contents.entries and all(isinstance(v, torch.Tensor) for v in contents.entries.values()):
        hint = (
            " It looks like a bare model state_dict: load it with "
            "model.load_state_dict(torch.load(path, weights_only=True))."
        )
    return (
        f"{said}: not a checkpoint written by speedups.save_checkpoint (a plain torch.save dict), and it has "
        f"no entry {absent}; it holds {held[:12]}{' ...' if len(held) > 12 else ''}. Map the names to its "
        f"entries: load_checkpoint(path, ..., keys={{{example}}}).{hint}"
    )


def _load_all(objects: dict[str, Any], ready: dict[str, Any]) -> None:
    """Load every object, all or none: objects checked beforehand (models, optimizers, schedulers, speedups
    objects) load last; any other object loads first, after a copy of its state is taken, and is put back if
    a later ``load_state_dict`` raises."""
    order = sorted(objects.items(), key=lambda item: is_checked(_unwrap(item[1])))
    done: list[tuple[Any, Any]] = []
    try:
        for name, obj in order:
            target = _unwrap(obj)
            before = None if is_checked(target) else copy.deepcopy(target.state_dict())
            target.load_state_dict(ready[name])
            done.append((target, before))
    except Exception:
        for target, before in reversed(done):
            if before is not None:
                target.load_state_dict(before)
        raise


def _restore_rng(every: list[dict[str, Any]]) -> None:
    rng = _rng_of_this_rank(every, "load_checkpoint")
    if rng is not None:
        set_rng_states(rng)


def _rng_of_this_rank(every: list[dict[str, Any]] | None, said: str) -> dict[str, Any] | None:
    """This rank's saved RNG states, checked; None (and a warning) when saved with another world size."""
    if every is None:
        return None
    world, rank = _env.world_size(), _env.rank()
    if len(every) == world:
        return _checkpoint_file.checked_rng(every[rank], said)
    if rank == 0:
        warnings.warn(
            f"load_checkpoint: saved with world size {len(every)}, loaded with {world}; RNG states were not "
            f"restored (everything else was).",
            SpeedupsWarning,
            stacklevel=3,
        )
    return None


# ----------------------------------------------------------------------------------------------- FSDP2
def _dcp_state(objects: dict[str, Any]) -> dict[str, Any]:
    """State dicts in torch.distributed.checkpoint's sharded form for FSDP2 models and their optimizers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    fsdp = _fsdp_type()
    models: list[nn.Module] = [o for o in objects.values() if fsdp is not None and isinstance(o, fsdp)]  # type: ignore[misc]
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if obj in models:
            out[name] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer) and (owner := _owner(obj, models)) is not None:
            out[name] = get_optimizer_state_dict(owner, obj)
        else:
            out[name] = obj.state_dict()
    return out


def _owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module | None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if ids <= {id(p) for p in model.parameters()}:
            return model
    return None


def _save_dcp(path: Path, objects: dict[str, Any], plain: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(objects)
    # Opaque blobs (the same on every rank after the gather), so DCP does not merge per-rank RNG tensors.
    state["_plain"] = _blob(plain)
    state["_rng"] = _blob(_gather_rng())
    dcp.save(state, checkpoint_id=str(path))  # collective; every rank writes its own shards


def _load_dcp(path: Path, objects: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    said = f"load_checkpoint({str(path)!r})"
    if not path.is_dir():
        raise FileNotFoundError(f"{said}: no FSDP2 checkpoint directory there.")
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    saved = {key.split(".")[0] for key in metadata.state_dict_metadata}
    missing = sorted(set(objects) - saved)
    if missing:
        raise SpeedupsError(
            f"{said}: {missing} were not saved; it holds {sorted(saved - {'_plain', '_rng'})}."
        )
    state = _dcp_state(objects)
    state["_plain"] = b""
    state["_rng"] = b""
    dcp.load(state, checkpoint_id=str(path))  # fills ``state`` in place (sharded tensors read per rank)
    fsdp = _fsdp_type()
    models: list[nn.Module] = [o for o in objects.values() if fsdp is not None and isinstance(o, fsdp)]  # type: ignore[misc]
    for name, obj in objects.items():
        if obj in models:
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer) and (owner := _owner(obj, models)) is not None:
            set_optimizer_state_dict(owner, obj, state[name])
        else:
            obj.load_state_dict(state[name])
    _restore_rng(_unblob(state["_rng"]))
    return dict(_unblob(state["_plain"]))


def _blob(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)

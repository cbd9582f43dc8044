"""Checkpoints that survive a crash and resume a distributed run exactly where it stopped.

``save_checkpoint(path, model=..., optimizer=..., loader=...)`` stores the ``state_dict()`` of every object
passed by name (the unwrapped keys of a DDP model), plain values (``step=120``) and the RNG states of every
rank. Rank 0 writes a temporary file next to ``path`` and renames it over ``path`` (``os.replace`` is atomic),
so a crash mid-write leaves the previous checkpoint intact; the other ranks wait until the file is complete.
``load_checkpoint(path, model=..., optimizer=..., loader=...)`` checks everything first and only then loads.
FSDP2 models go through ``torch.distributed.checkpoint`` (a directory of shards, each rank writes its own).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedups import _env, _rng
from speedups._rng import get_rng_states, set_rng_states
from speedups.distributed_loader import DistributedLoader
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "speedups.checkpoint/1"
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
            raise TypeError(
                f"{call}({name}={type(value).__name__}): expected an object with state_dict() and "
                f"load_state_dict() (model, optimizer, scheduler, DistributedLoader, LossTracker, ...) or a "
                f"plain value (number, string, tensor, list/dict of them). A plain DataLoader has no state: "
                f"pass distributed(loader) instead."
            )
    if not state and not allow_empty:
        raise ValueError(f"{call}(path): nothing to save or load. Pass objects by name, e.g. model=model.")
    return objects, plain


def _unwrap(obj: Any) -> Any:
    if isinstance(obj, nn.parallel.DistributedDataParallel):
        return obj.module  # save the plain module's keys, loadable without DDP
    return obj


def _rng_state() -> dict[str, Any]:
    """This process's RNG states (:func:`speedups._rng.get_rng_states`), in a form ``weights_only`` loads."""
    state = get_rng_states()
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def _set_rng_state(saved: dict[str, Any]) -> None:
    """Undo :func:`_rng_state`'s conversions and restore; states of devices or libraries absent here are
    skipped."""
    state = dict(saved)
    kind, *rest = state["random"]
    state["random"] = (kind, tuple(rest[0]), *rest[1:])  # weights_only loading turns tuples into lists
    np = _rng.numpy_or_none()
    if "numpy" in state:
        if np is None:
            del state["numpy"]
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            state["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    if "cuda" in state and not torch.cuda.is_available():
        del state["cuda"]
    if "mps" in state and not _rng.mps_available():
        del state["mps"]
    set_rng_states(state)


def _gather_rng() -> list[dict[str, Any]]:
    mine = _rng_state()
    if not _pg():
        return [mine]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)  # collective: checkpoints are saved by every rank
    return every


def save_checkpoint(path: str | os.PathLike[str], **state: Any) -> Path:
    """Save every named object's ``state_dict()``, plain values and every rank's RNG states to ``path``.

    Call it on **every rank** at the same point (it runs collectives: some ``state_dict()`` calls, the RNG
    gather, and a final wait); rank 0 alone writes. The file is written to a temporary name in the same
    directory, flushed to disk, then renamed over ``path`` (atomic), so a crash mid-write never leaves a
    broken checkpoint; the other ranks return only once the file is complete. A DDP model is saved as its
    unwrapped ``.module``, so its keys load into a plain model too. A :class:`~speedups.DistributedLoader`
    saves its epoch and position, so :func:`load_checkpoint` resumes mid-epoch without replaying or skipping
    a batch. With an FSDP2 model (``ddp_wrap(model, strategy="fsdp")``), ``path`` is a directory written by
    ``torch.distributed.checkpoint`` (each rank writes its shards; no full copy is gathered).

    Sync points: the ``state_dict()`` calls (a device-to-host copy for some), an ``all_gather_object`` of the
    RNG states and a broadcast from rank 0 after the write.

    Args:
        path: the checkpoint file (its directory is created), or directory for FSDP2.
        **state: objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler, loader,
            LossTracker, @accumulate step) and plain values (``step=120``), by the names used to load them.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: a value is neither stateful nor plain data.
        ValueError: nothing passed, or a name starts with ``_``.
        SpeedupsError: rank 0 could not write the file (raised on every rank).

    Example:
        >>> import tempfile, os
        >>> net = nn.Linear(2, 1)
        >>> d = tempfile.mkdtemp()
        >>> _ = save_checkpoint(os.path.join(d, "ckpt.pt"), model=net, step=3)
        >>> load_checkpoint(os.path.join(d, "ckpt.pt"), model=nn.Linear(2, 1))
        {'step': 3}
    """
    objects, plain = _split("save_checkpoint", state)
    path = Path(path)
    fsdp = _fsdp_type()
    if fsdp is not None and any(isinstance(o, fsdp) for o in objects.values()):
        _save_dcp(path, objects, plain)
        return path
    payload = {
        "format": _FORMAT,
        "world_size": _env.world_size(),
        "objects": {name: _unwrap(obj).state_dict() for name, obj in objects.items()},
        "plain": plain,
        "rng": _gather_rng(),
    }
    error = ""
    if _env.rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    torch.save(payload, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
    if _pg():
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)  # also the barrier: the file is complete now
        error = box[0]
    if error:
        raise SpeedupsError(
            f"save_checkpoint({str(path)!r}): rank 0 could not write the checkpoint ({error}). "
            f"Check that the directory is writable and has space."
        )
    return path


def load_checkpoint(path: str | os.PathLike[str], **state: Any) -> dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into the named objects, after checking everything first.

    Every rank reads the file (onto the CPU; ``load_state_dict`` moves values to each parameter's device).
    Before any object changes, it checks that the file is a speedups checkpoint, that every name passed was
    saved, that a model's keys and shapes match exactly, that an optimizer has the same parameter groups, and
    that a mid-epoch loader has the world size it was saved with; only then does it load each object and
    restore this rank's RNG states (skipped, with a warning, if the world size changed). Plain values saved
    (``step=120``) are returned. Loaded with ``torch.load(weights_only=True)``.

    Every rank must pass the same ``path`` (on shared storage for several nodes): rank 0 wrote it.

    Sync points: none beyond the copies ``load_state_dict`` makes to each parameter's device; no
    collective (FSDP2 through ``torch.distributed.checkpoint``, which is collective).

    Example:
        >>> import tempfile, os
        >>> model = torch.nn.Linear(2, 1)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = save_checkpoint(path, model=model, step=7)  # returns the path written
        >>> load_checkpoint(path, model=torch.nn.Linear(2, 1))
        {'step': 7}

    Args:
        path: the file (or FSDP2 directory) :func:`save_checkpoint` wrote.
        **state: the objects to restore, by the names they were saved under (a subset is fine).

    Returns:
        A dict of the plain values that were saved.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        TypeError: a value has no ``load_state_dict``.
        SpeedupsError: the file is not a speedups checkpoint, a name is missing from it, or a model or
            optimizer does not match what was saved. Nothing has been changed when it raises: what is
            checked is checked before anything loads, and if another object's own ``load_state_dict``
            raises, the objects loaded before it are put back.
    """
    objects, extra = _split("load_checkpoint", state, allow_empty=True)
    if extra:
        raise TypeError(
            f"load_checkpoint({', '.join(f'{k}=...' for k in extra)}): plain values cannot be loaded into; "
            f"they are returned: values = load_checkpoint(path, model=model)."
        )
    path = Path(path)
    fsdp = _fsdp_type()
    if fsdp is not None and any(isinstance(o, fsdp) for o in objects.values()):
        return _load_dcp(path, objects)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint({str(path)!r}): no checkpoint file there.")
    said = f"load_checkpoint({str(path)!r})"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpeedupsError(
            f"{said}: not a checkpoint written by speedups.save_checkpoint (torch.load: {first}). "
            f"Pass the path save_checkpoint wrote."
        ) from err
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise SpeedupsError(f"{said}: not a checkpoint written by speedups.save_checkpoint.")
    saved = payload["objects"]
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise SpeedupsError(f"{said}: {missing} were not saved; it holds {sorted(saved)}.")
    for name, obj in objects.items():
        _check(said, name, _unwrap(obj), saved[name])
    _load_all(objects, saved)
    _restore_rng(payload["rng"])
    return dict(payload["plain"])


def _load_all(objects: dict[str, Any], saved: dict[str, Any]) -> None:
    """Load every object, all or none: if one ``load_state_dict`` raises, the ones loaded before it are put
    back. Objects whose checkpoint was checked beforehand (models, optimizers, loaders) load last; the
    others (any object with a ``state_dict``, checked only by its own ``load_state_dict``) load first,
    each after a copy of its current state is taken."""
    checked = (nn.Module, torch.optim.Optimizer, DistributedLoader)
    order = sorted(objects.items(), key=lambda item: isinstance(_unwrap(item[1]), checked))
    done: list[tuple[Any, Any]] = []
    try:
        for name, obj in order:
            target = _unwrap(obj)
            before = None if isinstance(target, checked) else copy.deepcopy(target.state_dict())
            target.load_state_dict(saved[name])
            done.append((target, before))
    except Exception:
        for target, before in reversed(done):
            if before is not None:
                target.load_state_dict(before)
        raise


def _restore_rng(every: list[dict[str, Any]]) -> None:
    world, rank = _env.world_size(), _env.rank()
    if len(every) == world:
        _set_rng_state(every[rank])
    elif rank == 0:
        warnings.warn(
            f"load_checkpoint: saved with world size {len(every)}, loaded with {world}; RNG states were not "
            f"restored (everything else was).",
            SpeedupsWarning,
            stacklevel=3,
        )


def _check(said: str, name: str, obj: Any, saved: Any) -> None:
    if isinstance(obj, nn.Module):
        own = obj.state_dict()
        if set(own) != set(saved):
            raise SpeedupsError(
                f"{said}: {name}'s keys differ from the checkpoint's: "
                f"missing {sorted(set(own) - set(saved))}, "
                f"unexpected {sorted(set(saved) - set(own))}. Build the same model before loading."
            )
        for key, value in own.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(saved[key].shape):
                raise SpeedupsError(
                    f"{said}: {name}.{key} has shape {tuple(value.shape)} here and "
                    f"{tuple(saved[key].shape)} in the checkpoint. Build the same model before loading."
                )
    elif isinstance(obj, torch.optim.Optimizer):
        here = [len(g["params"]) for g in obj.param_groups]
        there = [len(g["params"]) for g in saved.get("param_groups", [])]
        if here != there:
            raise SpeedupsError(
                f"{said}: optimizer {name} has parameter groups of sizes {here} here and {there} in the "
                f"checkpoint. Build the optimizer over the same parameters before loading."
            )
        params = [p for g in obj.param_groups for p in g["params"]]
        ids = [i for g in saved.get("param_groups", []) for i in g["params"]]
        for param, index in zip(params, ids, strict=True):
            for key, value in saved.get("state", {}).get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise SpeedupsError(
                        f"{said}: optimizer {name}'s state {key!r} of parameter {index} has shape "
                        f"{tuple(value.shape)} in the checkpoint, the parameter {tuple(param.shape)} here. "
                        f"Build the optimizer over the same model before loading."
                    )
    elif isinstance(obj, DistributedLoader):
        world = obj.distributed_sampler.num_replicas
        if saved.get("batches") and saved.get("world_size") != world:
            raise SpeedupsError(
                f"{said}: loader {name} was saved mid-epoch with world size {saved.get('world_size')} and is "
                f"loaded with {world}: the batches would not line up. Resume with the same world size."
            )


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

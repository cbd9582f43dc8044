"""FSDP2 checkpoints: a directory of shards written and read by ``torch.distributed.checkpoint``.

The directory is complete or absent: ``torch.distributed.checkpoint`` writes into ``.<name>.partial`` next to
it, and rank 0 renames that over ``path`` once every rank has written (a crash mid-save leaves the previous
checkpoint, and a ``.partial`` directory the next save removes). Models and their optimizers are sharded by
``torch.distributed.checkpoint`` (which also reshards them for another world size); the per-rank objects
(loader, tracker, ``@accumulate`` step) and every rank's RNG states go in as one opaque blob of all ranks'
states, so each rank gets its own back. DCP writes one copy of an entry every rank holds, from a rank of its
choosing, so each blob is built from an all-gather: its meaning does not depend on the rank that writes it.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedups._helpers import env
from speedups._helpers.rng import set_rng_states
from speedups._helpers.tree import tree_map
from speedups.checkpoint import background as writes
from speedups.checkpoint.checks import check_class, check_entry
from speedups.checkpoint.entries import fsdp_type, saved_object
from speedups.checkpoint.file_format import Contents
from speedups.checkpoint.layout_change import changes_layout, states_for_this_layout
from speedups.checkpoint.rank_states import (
    gather_rank_states,
    is_per_rank,
    rng_of_this_rank,
    state_of_this_rank,
)
from speedups.errors import SpeedupsError

__all__ = ["load_sharded", "plain_values_of_directory", "save_sharded"]


def _dcp_state(objects: dict[str, Any], blobbed: set[str], plain_models: bool = False) -> dict[str, Any]:
    """State dicts for ``torch.distributed.checkpoint``: FSDP2 models and their optimizers (sharded) and the
    other objects that are the same on every rank (LR schedulers); per-rank objects go in a blob instead.

    An optimizer named in ``blobbed`` (one with no state yet: before its first step) goes in as the blob of
    its ``state_dict()`` (its hyperparameters): torch's ``get_optimizer_state_dict`` would initialise its
    state with a step of zero gradients, which changes the run (Adam's step count) and what is saved.
    ``plain_models``: every model among ``objects`` stands for an FSDP2 model saved under its name (a
    directory loaded without FSDP2: see :func:`load_sharded`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    models, owners = _models_and_owners(objects, plain_models)
    out = {
        name: o.state_dict() for name, o in objects.items()
        if o not in models and name not in owners and not is_per_rank(o)
    }  # fmt: skip
    for name, obj in objects.items():
        if obj in models:
            out[name] = get_model_state_dict(obj)
        elif name in owners:
            owner = owners[name]
            out[name] = _blob(obj.state_dict()) if name in blobbed else get_optimizer_state_dict(owner, obj)
    return out


def _without_state(objects: dict[str, Any]) -> set[str]:
    """The FSDP2 models' optimizers among ``objects`` that hold no state yet."""
    return {name for name in _models_and_owners(objects)[1] if not objects[name].state}


def _models_and_owners(
    objects: dict[str, Any], plain_models: bool = False
) -> tuple[list[nn.Module], dict[str, nn.Module]]:
    """The FSDP2 models among ``objects`` (``plain_models``: every model), and the model each optimizer
    among them belongs to."""
    fsdp = fsdp_type() if not plain_models else nn.Module
    models: list[nn.Module] = [o for o in objects.values() if fsdp is not None and isinstance(o, fsdp)]  # type: ignore[misc]
    owners: dict[str, nn.Module] = {}
    for name, obj in objects.items():
        owner = _owner(obj, models) if isinstance(obj, torch.optim.Optimizer) else None
        if owner is not None:
            owners[name] = owner
    return models, owners


def _buffers(objects: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """Each FSDP2 model's saved buffers, by model and buffer name: FSDP2 leaves buffers to each rank (no
    broadcast, unlike DDP), so batch statistics differ per rank, and DCP would write one rank's copy only."""
    out = {}
    models = _models_and_owners(objects)[0]
    for name, model in objects.items():
        if model in models:
            saved = model.state_dict()  # its keys only (sharded parameters are not gathered)
            out[name] = {key: b.detach() for key, b in model.named_buffers() if key in saved}
    return out


def _per_rank(objects: dict[str, Any], plain_models: bool = False) -> dict[str, Any]:
    models, owners = _models_and_owners(objects, plain_models)
    return {n: o for n, o in objects.items() if o not in models and n not in owners and is_per_rank(o)}


def _owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module | None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if ids <= {id(p) for p in model.parameters()}:
            return model
    return None


def save_sharded(
    path: Path,
    objects: dict[str, Any],
    plain: dict[str, Any],
    *,
    background: bool = False,
    then: Callable[[], None] | None = None,
) -> None:
    """Write an FSDP2 checkpoint directory with ``torch.distributed.checkpoint`` (collective); complete or
    absent (see the module's docstring). ``then`` runs on rank 0 once it is complete.

    ``background``: DCP's own ``async_save`` (its planning collectives on a gloo group of their own, made
    at the first such save, so they never interleave with the training's): the loop waits for the state's
    copy in host memory, DCP's thread writes it, and rank 0 renames it into place once every rank's part is
    written (:func:`speedups.checkpoint.background.track`: the next save and any load wait for it).

    Raises:
        SpeedupsError: the directory could not be moved into place (every rank), or the background save
            before this one failed (every rank, after this one was written or handed to DCP).
    """
    import torch.distributed.checkpoint as dcp

    partial = path.parent / f".{path.name}.partial"
    own = {name: obj.state_dict() for name, obj in _per_rank(objects).items()}  # a refusal raises here
    if env.rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save cut short before: never renamed
    # The same on every rank (also waits for the removal). On the CPU: the blobs are read back there anyway,
    # and another rank's CUDA tensors would land on its GPU in this process. Each rank's error of the
    # background save before this one goes along, so that every rank raises it.
    mine = {"objects": own, "plain": plain, "buffers": _buffers(objects), "error": writes.take_error()}
    gathered = gather_rank_states(tree_map(_on_cpu, mine), to_all=True)
    assert gathered is not None
    rng, every = gathered
    rank0, later = every["objects"][0], every["objects"][1:]
    per_rank = {name: [None] + [states[name] for states in later] for name in own} if later else {}
    state = _dcp_state(objects, _without_state(objects))
    # Opaque blobs, built from the gather alone: the same bytes' meaning on every rank, since DCP writes one
    # copy of an entry all ranks hold from whichever rank it picks (its smallest plan, not rank 0). Rank 0's
    # plain values, as in a checkpoint file rank 0 writes.
    state["_plain"] = _blob(every["plain"][0])
    state["_rng"] = _blob(rng)
    classes = {name: type(saved_object(obj)).__name__ for name, obj in objects.items()}
    ranks = {"world_size": len(rng), "rank0": rank0, "per_rank": per_rank, "buffers": every["buffers"]}
    state["_ranks"] = _blob({**ranks, "classes": classes})
    before = "; ".join(f"rank {r}: {e}" for r, e in enumerate(every["error"]) if e)
    if background:
        response = dcp.async_save(state, checkpoint_id=str(partial), process_group=_async_group())
        future: Any = getattr(response, "upload_completion", response)  # AsyncSaveResponse on some stagers
        writes.track(future, functools.partial(_complete, path, partial, then), path)
    else:
        dcp.save(state, checkpoint_id=str(partial))  # collective; every rank writes its own shards
        box = [""]
        if env.rank() == 0:
            try:
                _complete(path, partial, then)
            except OSError as err:
                box[0] = f"{type(err).__name__}: {err}"
        with env.on_comm_device():
            torch.distributed.broadcast_object_list(box, src=0)  # the directory is in place (or not) for all
        if box[0]:
            raise SpeedupsError(
                f"save_checkpoint({str(path)!r}): rank 0 could not move the written checkpoint into place "
                f"({box[0]}). Check that the directory is writable."
            )
    if before:
        raise SpeedupsError(
            f"save_checkpoint({str(path)!r}): the checkpoint before, written in the background, failed "
            f"({before}); this one was {'handed to the writer' if background else 'written'}. Save again if "
            f"that one mattered."
        )


def _complete(path: Path, partial: Path, then: Callable[[], None] | None) -> None:
    """Rank 0, once every rank's part is written: move ``partial`` over ``path`` (the previous checkpoint is
    replaced only now), then ``then()``. Other ranks: nothing."""
    if env.rank() != 0:
        return
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)
    if then is not None:
        then()


_GROUPS: dict[int, Any] = {}  # the gloo group of DCP's background saves, per default group


def _async_group() -> Any:
    """A gloo group of every rank for DCP's background saves (made once: a collective, every rank is here)."""
    key = id(torch.distributed.group.WORLD)
    if key not in _GROUPS:
        _GROUPS.clear()  # a group of an earlier default group, destroyed since
        _GROUPS[key] = torch.distributed.new_group(backend="gloo")
    return _GROUPS[key]


def load_sharded(path: Path, objects: dict[str, Any]) -> dict[str, Any]:
    """Load an FSDP2 checkpoint directory into ``objects``; return its plain values.

    With an FSDP2 model among ``objects`` it is collective (DCP reshards for this number of ranks);
    without one (a plain or DDP model, on any number of processes, a process group or none), every model
    among ``objects`` takes the FSDP2 model saved under its name, and each process reads it whole by itself.
    Per-rank objects (loader, step, tracker) on another number of processes are merged as a checkpoint
    file's are (:mod:`speedups.checkpoint.layout_change`); each rank's own buffers and RNG states come back
    on the same number of ranks only (else the buffers saved from one rank, and the RNG states as they are).

    Nothing changes when it raises: the per-rank states, the classes and the RNG states are read and checked
    first; DCP checks names and shapes before it reads a tensor into a model or an optimizer.

    Raises:
        SpeedupsError: an object's entry was not saved, or does not fit it (DCP's reason, for the sharded
            ones); LayoutError: this layout cannot continue the saved one (see ``layout_change``).
    """
    import torch.distributed.checkpoint as dcp

    said = f"load_checkpoint({str(path)!r})"
    if not path.is_dir():
        raise FileNotFoundError(f"{said}: no FSDP2 checkpoint directory there.")
    fsdp = fsdp_type()
    alone = fsdp is None or not any(isinstance(o, fsdp) for o in objects.values())
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {key.split(".")[0] for key in entries}
    blobbed = "_ranks" in saved  # per-rank objects in one blob (older directories: DCP entries)
    empty = {name for name in objects if isinstance(entries.get(name), dcp.metadata.BytesStorageMetadata)}
    per_rank = _per_rank(objects, plain_models=alone)
    missing = sorted(set(objects) - saved - (set(per_rank) if blobbed else set()))  # those: in _this_rank
    if missing:
        raise SpeedupsError(
            f"{said}: {missing} were not saved; it holds {sorted(saved - {'_plain', '_rng', '_ranks'})}."
        )
    blobs = _read(said, path, dict.fromkeys(["_plain", "_rng", *(["_ranks"] if blobbed else [])], b""), alone)
    ranks = _unblob(blobs["_ranks"]) if blobbed else {}
    ready: dict[str, Any] = {}
    if blobbed:  # every check that can refuse, before anything changes
        own = _this_rank(said, ranks, per_rank)
        ready = {name: check_entry(said, name, name, saved_object(obj), own[name], None, depth=4)
                 for name, obj in per_rank.items()}  # fmt: skip
    for name, obj in objects.items():
        kind = "optimizer" if isinstance(obj, torch.optim.Optimizer) else "scheduler"
        if kind == "optimizer" or isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            check_class(said, name, obj, ranks.get("classes", {}).get(name), kind)
    rng_states = _unblob(blobs["_rng"])
    rng, notes = None, []  # weights alone on another layout (evaluation, export): nothing trains, no word
    if not (_only_models(objects) and len(rng_states) != env.world_size()):
        with warnings.catch_warnings(record=True) as caught:  # checked now; said once the load went through
            warnings.simplefilter("always")
            rng = rng_of_this_rank(rng_states, said, None, 5)
        notes = list(caught)
    fresh = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer) and not o.state]
    state = _dcp_state(objects, empty, plain_models=alone)  # a fresh optimizer's state is made here
    if not blobbed:
        state.update({name: obj.state_dict() for name, obj in per_rank.items()})
    try:
        state = _read(said, path, state, alone)  # in place: the tensors are the objects' own
    except SpeedupsError:
        for optimizer in fresh:
            optimizer.state.clear()  # as it was: get_optimizer_state_dict made it
        raise
    _apply(objects, state, ready, ranks, empty, alone)
    if rng is not None:
        set_rng_states(rng)
    for note in notes:
        warnings.warn_explicit(note.message, note.category, note.filename, note.lineno)
    return dict(_unblob(blobs["_plain"]))


def _only_models(objects: dict[str, Any]) -> bool:
    return all(isinstance(o, nn.Module) for o in objects.values())


_INTO_OBJECTS = (
    "could not load it into these objects ({reason}). Load it into a model and optimizer with the parameters "
    "it was saved with (names and shapes); nothing was changed."
)


def _read(
    said: str, path: Path, state: dict[str, Any], alone: bool, failed: str = _INTO_OBJECTS
) -> dict[str, Any]:
    """``dcp.load`` of ``state`` (filled in place; returned). ``alone``: this process reads by itself.

    Raises:
        SpeedupsError: DCP refused: ``failed`` with DCP's reason (the first rank's: a missing key, a shape).
    """
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=alone)
    except BaseException as err:  # CheckpointException derives from BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        reason = failed.format(reason=_reason(err))
        raise SpeedupsError(f"{said}: torch.distributed.checkpoint {reason}") from err
    return state


def _apply(
    objects: dict[str, Any], state: dict[str, Any], ready: dict[str, Any], ranks: Mapping[str, Any],
    empty: set[str], alone: bool,
) -> None:  # fmt: skip
    """Put what DCP read (``state``) and the checked per-rank states (``ready``) into the objects."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    models, owners = _models_and_owners(objects, plain_models=alone)
    buffers = ranks.get("buffers")  # each rank's own buffers (older directories: none)
    own_buffers = buffers[env.rank()] if buffers and len(buffers) == env.world_size() else {}
    for name, obj in objects.items():
        if obj in models:
            own = own_buffers.get(name, {})
            set_model_state_dict(obj, {key: own.get(key, value) for key, value in state[name].items()})
        elif name in empty:  # saved before its first step: its hyperparameters, no state
            obj.load_state_dict(_unblob(state[name]))
        elif name in owners:
            set_optimizer_state_dict(owners[name], obj, state[name])
        else:
            saved_object(obj).load_state_dict(ready[name] if name in ready else state[name])


def _reason(err: BaseException) -> str:
    """The first rank's own exception inside DCP's ``CheckpointException`` (its message alone says only
    which ranks failed), else the exception's first line."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:  # {rank: (exception, traceback)}
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        err = inner if isinstance(inner, BaseException) else err
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def _this_rank(said: str, ranks: Mapping[str, Any], objects: dict[str, Any]) -> dict[str, Any]:
    """This rank's states of the per-rank ``objects`` from the blob of every rank's (merged on another
    world size, as a checkpoint file's are)."""
    own = ranks["rank0"]
    missing = sorted(set(objects) - set(own))
    if missing:
        raise SpeedupsError(f"{said}: {missing} were not saved; it holds {sorted(own)}.")
    contents = Contents(dict(own), {n: "" for n in own}, None, ranks["world_size"], None, ranks["per_rank"])
    names = {name: name for name in objects}
    if changes_layout(contents, objects, names):
        return states_for_this_layout(said, contents, objects, names)
    return {name: state_of_this_rank(name, own[name], ranks["per_rank"]) for name in objects}


def plain_values_of_directory(path: Path) -> dict[str, Any]:
    """The plain values of an FSDP2 checkpoint directory, read by this process alone (no collective)."""

    said = f"checkpoint_values({str(path)!r})"
    if not (path / ".metadata").is_file():
        raise SpeedupsError(
            f"{said}: a directory, but not an FSDP2 checkpoint (no .metadata in it, as "
            f"torch.distributed.checkpoint writes). Pass a checkpoint file, or the directory save_checkpoint "
            f"wrote for an FSDP2 model."
        )
    failed = (
        "could not read its plain values ({reason}). Was it written by save_checkpoint for an FSDP2 model?"
    )
    state = _read(said, path, {"_plain": b""}, True, failed)
    return dict(_unblob(state["_plain"]))


def _on_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _blob(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)

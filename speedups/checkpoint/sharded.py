"""FSDP2 checkpoints: a directory of shards written and read by ``torch.distributed.checkpoint``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedups.checkpoint.entries import fsdp_type
from speedups.checkpoint.rng_states import gather_rng, restore_rng
from speedups.errors import SpeedupsError

__all__ = ["load_sharded", "plain_values_of_directory", "save_sharded"]


def _dcp_state(objects: dict[str, Any]) -> dict[str, Any]:
    """State dicts in torch.distributed.checkpoint's sharded form for FSDP2 models and their optimizers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    fsdp = fsdp_type()
    models: list[nn.Module] = [o for o in objects.values() if fsdp is not None and isinstance(o, fsdp)]  # type: ignore[misc]
    owners: dict[str, nn.Module] = {}
    for name, obj in objects.items():
        owner = _owner(obj, models) if isinstance(obj, torch.optim.Optimizer) else None
        if owner is not None:
            owners[name] = owner
    # The other objects first: one that refuses (an @accumulate step mid-window) raises before torch's
    # get_optimizer_state_dict initialises an empty optimizer state with a step of zero gradients.
    out = {name: o.state_dict() for name, o in objects.items() if o not in models and name not in owners}
    for name, obj in objects.items():
        if obj in models:
            out[name] = get_model_state_dict(obj)
        elif name in owners:
            out[name] = get_optimizer_state_dict(owners[name], obj)
    return out


def _owner(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> nn.Module | None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models:
        if ids <= {id(p) for p in model.parameters()}:
            return model
    return None


def save_sharded(path: Path, objects: dict[str, Any], plain: dict[str, Any]) -> None:
    """Write an FSDP2 checkpoint directory with ``torch.distributed.checkpoint`` (collective)."""
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(objects)
    # Opaque blobs (the same on every rank after the gather), so DCP does not merge per-rank RNG tensors.
    state["_plain"] = _blob(plain)
    state["_rng"] = _blob(gather_rng())
    dcp.save(state, checkpoint_id=str(path))  # collective; every rank writes its own shards


def load_sharded(path: Path, objects: dict[str, Any]) -> dict[str, Any]:
    """Load an FSDP2 checkpoint directory into ``objects`` (collective); return its plain values."""
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
    fsdp = fsdp_type()
    models: list[nn.Module] = [o for o in objects.values() if fsdp is not None and isinstance(o, fsdp)]  # type: ignore[misc]
    for name, obj in objects.items():
        if obj in models:
            set_model_state_dict(obj, state[name])
        elif isinstance(obj, torch.optim.Optimizer) and (owner := _owner(obj, models)) is not None:
            set_optimizer_state_dict(owner, obj, state[name])
        else:
            obj.load_state_dict(state[name])
    restore_rng(_unblob(state["_rng"]))
    return dict(_unblob(state["_plain"]))


def plain_values_of_directory(path: Path) -> dict[str, Any]:
    """The plain values of an FSDP2 checkpoint directory, read by this process alone (no collective)."""
    import torch.distributed.checkpoint as dcp

    said = f"checkpoint_values({str(path)!r})"
    if not (path / ".metadata").is_file():
        raise SpeedupsError(
            f"{said}: a directory, but not an FSDP2 checkpoint (no .metadata in it, as "
            f"torch.distributed.checkpoint writes). Pass a checkpoint file, or the directory save_checkpoint "
            f"wrote for an FSDP2 model."
        )
    state: dict[str, Any] = {"_plain": b""}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except BaseException as err:  # CheckpointException derives from BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise SpeedupsError(
            f"{said}: torch.distributed.checkpoint could not read its plain values ({type(err).__name__}). "
            f"Was it written by save_checkpoint with an FSDP2 model?"
        ) from None
    return dict(_unblob(state["_plain"]))


def _blob(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)

"""The checkpoint file: its layout, the atomic write, and a read that says what it found.

Layout (``speedups.checkpoint/3``), a plain dict that ``torch.load(path, weights_only=True)`` reads without
``speedups`` installed::

    {
        "model": {...},            # each object's state_dict() (rank 0's), under the name it was saved with;
        "optimizer": {...},        # a model's keys carry no wrapper prefix (DDP ``module.``, ``_orig_mod.``)
        "epoch": 3,                # plain values, as given
        "_speedups": {"format": "speedups.checkpoint/3", "world_size": 2,
                      "objects": {"model": "Linear", "optimizer": "SGD"},  # name -> class name
                      "rng": [...],  # per rank: torch, random, numpy (as a tensor), cuda/mps states
                      "per_rank": {"step": [None, {...}]}},  # objects whose state differs per rank: the
    }                                                         # state of rank r at index r (None: the entry)

Files of the layouts before (``speedups.checkpoint/2``: no ``per_rank``; ``/1``: ``{"format", "objects",
"plain", "rng"}``) are still read. Any other dict is *foreign* (a plain ``torch.save`` dict of some training
script): its entries are loaded by name, no RNG state is restored.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from speedups._helpers import rng
from speedups._helpers.tree import tree_map
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["FORMAT", "META", "Contents", "checked_rng", "read", "rng_from_file", "rng_to_file", "write"]

FORMAT = "speedups.checkpoint/3"
_BEFORE_PER_RANK = "speedups.checkpoint/2"  # read: no per-rank states (rank 0's only)
_LEGACY = "speedups.checkpoint/1"
META = "_speedups"  # the entry holding the format, the objects' classes and the RNG states


@dataclasses.dataclass
class Contents:
    """What a checkpoint file holds, whatever its layout."""

    entries: dict[str, Any]  # every entry by name: objects' states and plain values
    objects: dict[str, str] | None  # speedups files: which entries are object states (-> class name)
    rng: list[dict[str, Any]] | None = None  # per rank; None for foreign files
    world_size: int | None = None
    rng_ranks: list[int] | None = None  # the ranks whose states ``rng`` holds, in order; None: every rank
    per_rank: dict[str, list[Any]] | None = None  # per-rank objects' states by rank (index 0: the entry)

    @property
    def foreign(self) -> bool:
        return self.objects is None


def _file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (``torch.save``'s mode)."""
    try:
        with open("/proc/self/status") as status:  # Linux: read without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)  # elsewhere: set and put back at once (no file is created in between)
    os.umask(umask)
    return 0o666 & ~umask


def _compact(value: Any) -> Any:
    """A dense tensor in another memory layout (channels_last, a transposed view) as a contiguous copy."""
    if isinstance(value, torch.Tensor) and value.layout is torch.strided and not value.is_contiguous():
        return value.contiguous()
    return value


def write(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to a temporary file next to ``path``, flush it to disk, rename it over ``path``.

    Tensors are written contiguous: read with plain ``torch.load``, optimizer state saved under
    ``fast_kernels`` (channels_last) would keep that layout (``Optimizer.load_state_dict`` keeps strides)
    beside contiguous weights, and a fused optimizer pairs their elements by position.
    :func:`~speedups.load_checkpoint` lays state out as its parameters whatever the file holds.

    A crash mid-write leaves the previous file intact. The file's mode follows the umask, like
    ``torch.save`` (``tempfile.mkstemp`` alone would make it 0600, unreadable to a teammate).

    Raises:
        OSError: the directory cannot be created or written, or ``path`` is a directory.
    """
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; pass a file name, e.g. {path / 'ckpt.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tree_map(_compact, payload), f)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), _file_mode())
            else:  # pragma: no cover (Windows)
                os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read(path: Path, said: str) -> Contents:
    """Read ``path`` onto the CPU with ``weights_only=True`` and sort its entries.

    Raises:
        FileNotFoundError: nothing at ``path``.
        SpeedupsError: ``path`` is a directory; the file is empty, truncated, damaged, not a ``torch.save``
            file, holds Python objects ``weights_only`` refuses, or is not a dict. The message names the
            path and what was found.
    """
    if path.is_dir():
        raise SpeedupsError(
            f"{said}: this is a directory, but not an FSDP2 checkpoint (no .metadata in it, as "
            f"torch.distributed.checkpoint writes). Pass the file save_checkpoint wrote, or the directory it "
            f"wrote for an FSDP2 model."
        )
    if not path.exists():
        raise FileNotFoundError(f"{said}: no checkpoint file there.")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises OSError, RuntimeError, UnpicklingError, EOFError, ... here
        raise SpeedupsError(_unreadable(said, size, head, err)) from err
    if not isinstance(payload, dict):
        raise SpeedupsError(
            f"{said}: the file holds a {type(payload).__name__}, not a dict of entries. Checkpoints are "
            f"dicts: save_checkpoint(path, model=model, ...) or torch.save({{'model': model.state_dict()}})."
        )
    meta = payload.get(META)
    if isinstance(meta, dict) and meta.get("format") in (FORMAT, _BEFORE_PER_RANK):
        objects, states = meta.get("objects"), meta.get("rng")
        if not (isinstance(objects, dict) and all(isinstance(v, str) for v in objects.values())) or not (
            states is None or (isinstance(states, list) and all(isinstance(r, dict) for r in states))
        ):
            raise SpeedupsError(
                f"{said}: its {META!r} entry is damaged (expected 'objects' a dict of class names and "
                f"'rng' a list of per-rank dicts; got {type(objects).__name__} and {type(states).__name__}). "
                f"Resume from an earlier checkpoint, or load its entries yourself with "
                f"torch.load(path, weights_only=True)."
            )
        entries = {k: v for k, v in payload.items() if k != META}
        ranks = meta.get("rng_ranks")
        if ranks is not None and not (
            isinstance(ranks, list) and all(type(r) is int for r in ranks) and len(ranks) == len(states or [])
        ):
            raise SpeedupsError(
                f"{said}: its {META!r} entry is damaged ('rng_ranks' is not a list of ranks, one per saved "
                f"RNG state). Resume from an earlier checkpoint."
            )
        per_rank = meta.get("per_rank")
        if per_rank is not None and not (
            isinstance(per_rank, dict)
            and all(isinstance(v, list) and k in entries for k, v in per_rank.items())
        ):
            raise SpeedupsError(
                f"{said}: its {META!r} entry is damaged ('per_rank' is not a dict of saved names to lists of "
                f"per-rank states). Resume from an earlier checkpoint."
            )
        return Contents(entries, dict(objects), states, meta.get("world_size"), ranks, per_rank)
    if payload.get("format") == _LEGACY and {"objects", "plain", "rng"} <= set(payload):
        objects = {name: "" for name in payload["objects"]}  # class names were not recorded then
        entries = {**payload["plain"], **payload["objects"]}
        return Contents(entries, objects, payload["rng"], payload.get("world_size"))
    if isinstance(meta, dict):
        raise SpeedupsError(
            f"{said}: written in checkpoint format {meta.get('format')!r}; this speedups reads {FORMAT!r}, "
            f"{_BEFORE_PER_RANK!r} and {_LEGACY!r}. Upgrade speedups to load it."
        )
    return Contents(dict(payload), None)


def _unreadable(said: str, size: int, head: bytes, err: Exception) -> str:
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    cause = f"{type(err).__name__}: {first}" if first else type(err).__name__
    if size == 0:
        return (
            f"{said}: the file is empty (0 bytes), so it was cut off or never written; save_checkpoint never "
            f"leaves one (it writes atomically). Resume from an earlier checkpoint."
        )
    if "Unsupported global" in text:
        return (
            f"{said}: the file holds pickled Python objects that torch.load(weights_only=True) refuses "
            f"({cause}). Save state dicts and plain values (save_checkpoint does); for a file you trust, "
            f"torch.load(path, weights_only=False) yourself and call load_state_dict."
        )
    if head.startswith(b"PK\x03\x04"):
        return (
            f"{said}: a torch.save archive of {size} bytes that cannot be read: it is truncated or damaged "
            f"(torch.load: {cause}). Copy it again, or resume from an earlier checkpoint."
        )
    return (
        f"{said}: not a checkpoint written by speedups.save_checkpoint or torch.save ({size} bytes starting "
        f"{head!r}; torch.load: {cause}). Pass the path save_checkpoint wrote."
    )


def rng_to_file(state: dict[str, Any]) -> dict[str, Any]:
    """RNG states (:func:`speedups._helpers.rng.get_rng_states`) in a form ``weights_only`` loads."""
    state = dict(state)
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def checked_rng(saved: Any, said: str) -> dict[str, Any]:
    """:func:`rng_from_file`, tried on throwaway generators first; nothing global changes.

    Raises:
        SpeedupsError: the saved states are damaged (the message names the checkpoint).
    """
    try:
        state = rng_from_file(saved)
        torch.Generator().set_state(state["torch"])
        random.Random().setstate(state["random"])
        if "numpy" in state:
            rng.numpy_or_none().random.RandomState().set_state(state["numpy"])
        for key in ("cuda", "mps"):
            values = state.get(key)
            values = values if isinstance(values, list) else [] if values is None else [values]
            if not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in values):
                raise TypeError(f"{key} states must be uint8 tensors")
    except Exception as err:
        raise SpeedupsError(
            f"{said}: its saved RNG states are damaged ({type(err).__name__}: {err}). Nothing was loaded. "
            f"Resume from an earlier checkpoint."
        ) from err
    return state


def rng_from_file(saved: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`rng_to_file`; states of devices or libraries absent here are left out."""
    state = dict(saved)
    kind, *rest = state["random"]
    state["random"] = (kind, tuple(rest[0]), *rest[1:])  # weights_only loading turns tuples into lists
    np = rng.numpy_or_none()
    if "numpy" in state:
        if np is None:
            del state["numpy"]
        else:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            state["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    if "cuda" in state and not torch.cuda.is_available():
        del state["cuda"]
    elif (
        "cuda" in state
        and isinstance(state["cuda"], list)
        and len(state["cuda"]) != torch.cuda.device_count()
    ):
        had, sees = len(state.pop("cuda")), torch.cuda.device_count()
        warnings.warn(  # device i then is not device i now: restoring some of them would be a guess
            f"load_checkpoint: the checkpoint holds the CUDA RNG states of {had} GPUs and this process "
            f"sees {sees} (CUDA_VISIBLE_DEVICES changed?); the CUDA RNG states were not restored, everything "
            f"else was.",
            SpeedupsWarning,
            stacklevel=4,
        )
    if "mps" in state and not rng.mps_available():
        del state["mps"]
    return state

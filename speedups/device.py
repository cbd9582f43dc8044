"""Tip 6: move whole nested batches to the device in one call, keeping their structure.

``to_device(batch)`` walks dicts, lists, tuples, namedtuples and dataclasses and moves every tensor (and every
module, and every object with a ``.to`` method) to this process's device, so a training loop never writes
``x, y = x.to(dev), y.to(dev)`` for each field again.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from speedups._helpers import env
from speedups._helpers.moving import DeviceLike, LeafMover, moves_itself
from speedups._helpers.tree import tree_map
from speedups.errors import SpeedupsError

__all__ = ["to_device", "default_device", "resolve_device"]

T = TypeVar("T")


def default_device() -> torch.device:
    """Return this process's device: its CUDA device, else ``mps``, else ``cpu``.

    One rule for every launch style (written once in ``speedups._helpers.env``): under torchrun or
    :func:`~speedups.launch`, ``cuda:LOCAL_RANK`` (never the global rank, so a second node uses its own GPUs
    0..k-1); under ``srun``, ``cuda:(SLURM_LOCALID % visible GPUs)`` (``cuda:0`` when SLURM binds one GPU per
    task, indices within ``CUDA_VISIBLE_DEVICES``); in processes that made their own process group
    (``mp.spawn``), the current CUDA device (``torch.cuda.set_device``); else the current device.

    Raises:
        SpeedupsError: under torchrun, the local rank names a GPU this process cannot see.

    Example:
        >>> default_device().type in {"cuda", "mps", "cpu"}
        True
    """
    return env.device()


def _available_devices() -> list[str]:
    names = ["cpu", "meta"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def resolve_device(
    device: DeviceLike | None, *, call: str = "resolve_device", argument: str = "device"
) -> torch.device:
    """Turn ``device`` into a ``torch.device`` that exists on this machine.

    Args:
        device: ``None`` (this process's :func:`default_device`), an int (a CUDA index), a string such as
            ``"cuda:1"``, ``"cpu"``, ``"meta"``, or a ``torch.device``.
        call: the public function's name, quoted in error messages.
        argument: the argument's name, quoted in error messages.

    Returns:
        The device. ``"cuda"`` without an index becomes the current CUDA device.

    Raises:
        TypeError: ``device`` is of another type.
        ValueError: the string is not a device name.
        SpeedupsError: the device is well formed but not present here (the message lists what is).
    """
    if device is None:
        return default_device()
    said = f"{call}({argument}={device!r})"
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"{said}: expected a torch.device, a string like 'cuda:0' or 'cpu', "
            f"an int (CUDA index) or None, got {type(device).__name__}."
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(
            f"{said}: {device!r} is not a device name. Available here: {', '.join(_available_devices())}."
        ) from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index is None:
            if count == 0:
                raise SpeedupsError(_missing(said))
            return torch.device("cuda", torch.cuda.current_device())
        if not 0 <= dev.index < count:
            raise SpeedupsError(_missing(said))
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise SpeedupsError(_missing(said))
    elif dev.type not in ("cpu", "meta"):
        backend = getattr(torch, dev.type, None)
        is_available = getattr(backend, "is_available", None)
        if is_available is None or not is_available():
            raise SpeedupsError(_missing(said))
    return dev


def _missing(said: str) -> str:
    hint = " (or device=None for this process's default device)" if "(device=" in said else ""
    return (
        f"{said}: that device is not available on this machine. "
        f"Available here: {', '.join(_available_devices())}. Pass one of those{hint}."
    )


def to_device(obj: T, device: DeviceLike | None = None, *, non_blocking: bool | None = None) -> T:
    """Move every tensor and module inside ``obj`` to ``device``, keeping the nesting and container types.

    Walks any nesting of dict, OrderedDict, defaultdict (its ``default_factory`` kept), other ``Mapping``
    and ``UserDict`` subclasses, list, tuple, namedtuple, deque, set, frozenset and dataclass instances
    (frozen ones and ``field(init=False)`` values included). Tensors move with ``Tensor.to``; modules move
    in place with ``nn.Module.to`` (as torch does); any other object with a ``.to`` method gets
    ``obj.to(device)``, also when it is a container itself (``PackedSequence``, a tokenizer's batch);
    everything else (strings, numbers, None) is returned as is; an object of another class that holds
    tensors in its attributes is returned as is with one :class:`~speedups.SpeedupsWarning` per class
    naming it (make it a dataclass, or give it a ``.to``). ``obj`` itself is never modified: every
    container is rebuilt. Tensors keep their dtype and shape.

    Sync points: none. A copy to a CUDA device is asynchronous when ``non_blocking`` is True, which is safe
    only from pinned host memory; the default (``None``) chooses True exactly there (a pinned CPU tensor
    going to CUDA) and False everywhere else, so a later host read never sees a half-copied tensor.

    Args:
        obj: a tensor, module, or nested container of them.
        device: target device; ``None`` means this process's :func:`default_device`
            (``cuda:<LOCAL_RANK>``, else ``mps``, else ``cpu``).
        non_blocking: force asynchronous copies on (True) or off (False); None chooses per tensor.

    Returns:
        A structure of the same types as ``obj`` with its tensors on ``device``.

    Raises:
        TypeError: ``device`` or ``non_blocking`` has the wrong type.
        ValueError: ``device`` is not a device name, or ``obj`` contains itself.
        SpeedupsError: ``device`` does not exist on this machine; the message lists the ones that do.

    Example:
        >>> batch = {"x": torch.ones(2, 3), "ids": ["a", "b"]}
        >>> moved = to_device(batch, "meta")
        >>> moved["x"].device, moved["ids"], batch["x"].device
        (device(type='meta'), ['a', 'b'], device(type='cpu'))
    """
    if non_blocking is not None and not isinstance(non_blocking, bool):
        raise TypeError(f"to_device(non_blocking={non_blocking!r}): expected True, False or None.")
    target = resolve_device(device, call="to_device")
    try:
        return tree_map(LeafMover(target, non_blocking), obj, moves_itself)
    except RecursionError:
        raise ValueError(
            f"to_device(<{type(obj).__name__}>): the input nests too deeply or contains itself (a reference "
            f"cycle), so it cannot be walked. Pass a tree of containers (dicts, lists, tuples, dataclasses)."
        ) from None

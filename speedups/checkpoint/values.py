"""The plain values of a checkpoint, read without loading any object: what a script builds its model from."""

from __future__ import annotations

import os
from typing import Any

import torch

from speedups.checkpoint import background as writes
from speedups.checkpoint import file_format
from speedups.checkpoint.entries import check_path, is_plain
from speedups.checkpoint.sharded import plain_values_of_directory

__all__ = ["checkpoint_values"]


def checkpoint_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the plain values saved in a checkpoint (``model_args``, ``epoch``, ...), loading no object.

    For scripts whose model's shape lives in the checkpoint (nanoGPT's ``model_args``): read the values,
    build the model from them, then :func:`~speedups.load_checkpoint` into it. Works on files written by
    :func:`~speedups.save_checkpoint` (the values passed by name), on FSDP2 checkpoint directories, and on
    foreign ``torch.save`` dicts (their entries that are plain data: numbers, strings, tensors, and lists
    and dicts of them, not state dicts). Every rank may call it: it reads, with no collective.

    Sync points: none (a file read; tensors come back on the CPU).

    Args:
        path: the checkpoint file or FSDP2 directory.

    Returns:
        A dict of the plain values by name.

    Raises:
        FileNotFoundError: nothing at ``path``.
        TypeError, ValueError: ``path`` is not a file name.
        SpeedupsError: the file is empty, truncated, damaged or not a dict (the message names it).

    Example:
        >>> import tempfile, os, torch
        >>> from speedups import save_checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> _ = save_checkpoint(path, model=torch.nn.Linear(4, 2), model_args={"n_in": 4, "n_out": 2})
        >>> args = checkpoint_values(path)["model_args"]
        >>> model = torch.nn.Linear(args["n_in"], args["n_out"])   # then load_checkpoint(path, model=model)
    """
    path = check_path("checkpoint_values", path)
    writes.wait()  # a checkpoint this process writes in the background is complete before it is read
    said = f"checkpoint_values({str(path)!r})"
    if path.is_dir():
        return plain_values_of_directory(path)
    contents = file_format.read(path, said)
    if contents.foreign:
        return {k: v for k, v in contents.entries.items() if is_plain(v) and not _state_dict_like(v)}
    classes = contents.objects or {}
    return {k: v for k, v in contents.entries.items() if k not in classes}


def _state_dict_like(value: Any) -> bool:
    """An object's state stored in a foreign file, not a value: a module's state_dict (tensors by name) or an
    optimizer's (``state`` and ``param_groups``)."""
    if not isinstance(value, dict) or not value:
        return False
    optimizer = {"state", "param_groups"} <= set(value)
    return optimizer or all(isinstance(v, torch.Tensor) for v in value.values())

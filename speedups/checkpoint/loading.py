"""Resuming a run bit for bit: every entry checked before any object changes, then all loaded or none.

``load_checkpoint(path, model=..., optimizer=..., loader=...)`` checks every entry first
(:mod:`speedups.checkpoint.checks`) and only then loads; it also loads foreign ``torch.save`` dicts
(``keys={"model": "state_dict"}``). FSDP2 directories go through :mod:`speedups.checkpoint.sharded`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch

from speedups._helpers import env, validate
from speedups._helpers.arrival import arrive
from speedups._helpers.rng import set_rng_states
from speedups._helpers.state_strides import follow_strides, state_follows_params
from speedups.checkpoint import background as writes
from speedups.checkpoint import file_format
from speedups.checkpoint.checks import check_entry, has_own_check, is_checked
from speedups.checkpoint.entries import check_path, holds_fsdp, refuse_positional, saved_object, split_state
from speedups.checkpoint.layout_change import changes_layout, states_for_this_layout
from speedups.checkpoint.rank_states import rng_of_this_rank, state_of_this_rank
from speedups.checkpoint.sharded import load_sharded
from speedups.errors import SpeedupsError

__all__ = ["load_checkpoint", "load_contents"]


def load_checkpoint(
    path: str | os.PathLike[str],
    *unnamed: Any,
    keys: Mapping[str, str] | None = None,
    strict: bool = True,
    **state: Any,
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

    An optimizer's state tensors of a parameter's shape (``exp_avg``, ``momentum_buffer``, ...) and the
    restored gradients take that parameter's memory layout, values exact (``Optimizer.load_state_dict``
    keeps the saved strides, and a fused step pairs them in memory order): a checkpoint saved while
    :func:`~speedups.fast_kernels` made convolutions channels_last resumes a plain run, and the other way.

    A foreign file (any ``torch.save`` dict) loads too: ``keys`` maps argument names to its entries, e.g.
    ``load_checkpoint(path, model=m, optimizer=o, keys={"model": "state_dict"})`` returns its other entries
    (``{"epoch": 3, ...}``); no RNG state is restored from it. Every rank passes the same ``path``.

    Sync points: none beyond the copies ``load_state_dict`` makes to each parameter's device; no
    collective (FSDP2 through ``torch.distributed.checkpoint``, which is collective).

    Args:
        path: the file (or FSDP2 directory) to read.
        keys: argument name -> the file's entry, where they differ (``{"model": "state_dict"}``).
        strict: False loads a model's matching entries only (same name and shape), as
            ``nn.Module.load_state_dict(strict=False)`` does: a backbone into a model with a new head. The
            keys missing from the file, the unexpected ones and those of another shape are named in one
            ``SpeedupsWarning`` (rank 0). Other objects are checked strictly either way.
        **state: the objects to restore, by name (a subset of what was saved is fine).

    Returns:
        The plain values saved (``{"epoch": 3}``); for a foreign file, every entry not loaded.

    Raises:
        FileNotFoundError: no file at ``path``.
        TypeError, ValueError: a value has no ``load_state_dict``, or comes by position (it needs its
            name); ``keys`` is not a dict of names, or names an object not passed; an entry a speedups
            object refuses.
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
    check_path("load_checkpoint", path)
    refuse_positional("load_checkpoint", unnamed)
    writes.wait()  # a checkpoint this process writes in the background is complete before it is read
    objects, extra = split_state("load_checkpoint", state, allow_empty=True)
    if extra:
        raise TypeError(
            f"load_checkpoint({', '.join(f'{k}=...' for k in extra)}): plain values cannot be loaded into; "
            f"they are returned: values = load_checkpoint(path, model=model)."
        )
    with validate.arguments(f"load_checkpoint(path, strict={strict!r})"):
        validate.flag(strict, "strict")
    entry_of = _check_keys(keys, objects)
    path = check_path("load_checkpoint", path)
    said = f"load_checkpoint({str(path)!r})"
    sharded = holds_fsdp(objects)
    if sharded or (path / ".metadata").is_file():  # an FSDP2 directory: into FSDP2, or plain models
        if keys:
            raise ValueError(
                f"{said}: keys= maps entries of a checkpoint file, not of an FSDP2 directory. Pass each "
                f"object by the name it was saved under (model=..., optimizer=...)."
            )
        if sharded:
            arrive("load_checkpoint")  # FSDP2 loads are collective
        values = load_sharded(path, objects)
        _layouts_follow_params(objects)
        return values
    return load_contents(said, file_format.read(path, said), objects, entry_of, strict=strict, depth=2)


def load_contents(
    said: str,
    contents: file_format.Contents,
    objects: dict[str, Any],
    entry_of: Mapping[str, str] | None = None,
    *,
    strict: bool = True,
    depth: int = 1,
) -> dict[str, Any]:
    """:func:`load_checkpoint` of a file already read (a run directory reads it to know it is whole).

    ``depth``: the frames between the caller's code and this call, for the warnings (1: load_checkpoint).
    """
    entry_of = entry_of or {name: name for name in objects}
    entries = contents.entries
    missing = [name for name in objects if entry_of[name] not in entries]
    if missing:
        raise SpeedupsError(_missing(said, missing, entry_of, contents, objects))
    classes = contents.objects or {}
    saved = {name: state_of_this_rank(entry_of[name], entries[entry_of[name]], contents.per_rank)
             for name in objects}  # fmt: skip
    if changes_layout(contents, objects, entry_of):  # another number of processes, or of micro-steps
        saved = states_for_this_layout(said, contents, objects, entry_of)
    ready = {
        name: check_entry(said, name, entry_of[name], saved_object(obj), saved[name],
                          classes.get(entry_of[name]), strict=strict, depth=depth)
        for name, obj in objects.items()
    }  # fmt: skip
    rng = None  # weights alone on another layout (evaluation, export): nothing trains, nothing to say
    if not (all(isinstance(o, torch.nn.Module) for o in objects.values()) and _other_layout(contents)):
        rng = rng_of_this_rank(contents.rng, said, contents.rng_ranks, depth + 2)  # checked before any change
    _load_all(objects, ready, strict)
    _layouts_follow_params(objects)
    if rng is not None:
        set_rng_states(rng)
    used = set(entry_of.values())
    if contents.foreign:
        return {k: v for k, v in entries.items() if k not in used}
    return {k: v for k, v in entries.items() if k not in classes and k not in used}


def _layouts_follow_params(objects: Mapping[str, Any]) -> None:
    """Lay out every loaded optimizer state tensor of its parameter's shape, and every gradient (the open
    window an ``@accumulate`` step restores), as its parameter is, in place, values exact.

    ``Optimizer.load_state_dict`` keeps the strides the state was saved with: saved while ``fast_kernels``
    made convolution weights channels_last and loaded into a contiguous model (or the other way), a fused
    step would pair a weight and its state in memory order, wrong elements together (0.046 off in 3 steps).
    """
    for obj in objects.values():
        target = saved_object(obj)
        if issubclass(type(target), torch.optim.Optimizer):
            state_follows_params(target, grads=True)
        elif isinstance(target, torch.nn.Module):
            with torch.no_grad():
                for param in target.parameters():
                    if param.grad is not None:
                        follow_strides(param.grad, param)


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


def _missing(
    said: str, missing: list[str], entry_of: Mapping[str, str], contents: Any, objects: Mapping[str, Any]
) -> str:
    held = sorted(contents.entries)
    absent = [entry_of[n] for n in missing]
    if not contents.foreign:
        return f"{said}: {absent} were not saved; it holds {held}."
    ours = [n for n in missing if has_own_check(saved_object(objects[n]))]  # steps, trackers, loaders, ...
    if ours:
        kept = ", ".join(f"{n}=..." for n in objects if n not in ours) or "model=..."
        return (
            f"{said}: not a checkpoint written by speedups.save_checkpoint (a plain torch.save dict), so it "
            f"cannot hold the state of {ours}: only save_checkpoint writes what a speedups object keeps. "
            f"Leave {'it' if len(ours) == 1 else 'them'} out, to start afresh: load_checkpoint(path, {kept})."
        )
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


def _other_layout(contents: file_format.Contents) -> bool:
    """Whether the file's RNG states are not every rank's of this layout (saved on another world size)."""
    return contents.rng is not None and contents.rng_ranks is None and len(contents.rng) != env.world_size()


def _load_all(objects: dict[str, Any], ready: dict[str, Any], strict: bool) -> None:
    """Load every object, all or none: objects checked beforehand (models, optimizers, schedulers, speedups
    objects) load last; any other object loads first, after a copy of its state is taken, and is put back if
    a later ``load_state_dict`` raises."""
    order = sorted(objects.items(), key=lambda item: is_checked(saved_object(item[1])))
    done: list[tuple[Any, Any]] = []
    try:
        for name, obj in order:
            target = saved_object(obj)
            before = None if is_checked(target) else copy.deepcopy(target.state_dict())
            if isinstance(target, torch.nn.Module):
                target.load_state_dict(ready[name], strict=strict)  # non-strict: the checked subset
            else:
                target.load_state_dict(ready[name])
            done.append((target, before))
    except Exception:
        for target, before in reversed(done):
            if before is not None:
                target.load_state_dict(before)
        raise

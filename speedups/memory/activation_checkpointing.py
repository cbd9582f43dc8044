"""Activation checkpointing by name: blocks of a model recompute their activations in backward.

Training keeps every activation the backward will need; activation checkpointing (Chen et al., "Training
Deep Nets with Sublinear Memory Cost", 2016) keeps only each checkpointed block's inputs and runs the block's
forward again in backward, trading about one more forward of those blocks for their activations' memory.
:func:`checkpoint_activations` does it to the blocks you name, with removable module hooks around torch's own
non-reentrant checkpoint (see :mod:`speedups.memory.recompute`); :func:`uncheckpoint_activations` undoes it.
"""

from __future__ import annotations

import sys
from typing import TypeVar

import torch
from torch import nn

from speedups._helpers.wrappers import unwrap
from speedups.errors import SpeedupsError
from speedups.memory.blocks import NameSpec, checked_call, overlaps, pick_modules, undo_roots
from speedups.memory.recompute import ATTR, Recompute

__all__ = ["checkpoint_activations", "checkpointed", "checkpointed_modules", "uncheckpoint_activations"]

M = TypeVar("M", bound=nn.Module)


def checkpoint_activations(model: M, names: NameSpec, *, enabled: bool = True) -> M:
    """Make the named blocks of ``model`` recompute their activations in backward instead of keeping them.

    Each block picked keeps only its inputs for backward; the first backward that needs its activations runs
    its forward again, with the RNG states of the forward (dropout draws the same masks) and the same autocast
    state, so gradients and weights are bit for bit those of the run without checkpointing (and of a
    hand-written ``torch.utils.checkpoint(block, x, use_reentrant=False)``). It saves the activations of
    those blocks at about one more forward of them; it does not help blocks whose saved tensors are few
    (``profile_steps(model=...)`` shows the bytes per block). Buffers a forward writes (BatchNorm's running
    statistics) are put back after each recompute, so they end as a plain run leaves them. Composes with
    ``@accumulate`` (micro-batching too), ``mixed_precision``, ``ddp_wrap``, FSDP2's ``fully_shard`` (before
    or after it) and ``torch.compile`` (under a whole-model compile a checkpointed block runs eagerly, as its
    recompute does: a graph break around it; a block compiled on its own, by :func:`~speedups.compile_blocks`
    in either order, runs its compiled code in forward and recompute alike; compiled code is reset so the
    hooks are seen). Only calls through ``block(...)`` count.
    Side effects of a forward other than its buffers (a Python counter, a list appended to) run again.
    Sync points: none.

    Args:
        model: the model (plain, DDP-wrapped, FSDP2-sharded or compiled); hooks go on its plain module's
            blocks, in place. Names are those of the plain model's ``named_modules()``.
        names: a dotted submodule name, a pattern (``"blocks.*"``, ``"transformer.h.*"``; a ``*`` matches
            one part of a dotted name), a module class (``Block``: every module of that class), or a list of
            them. Of the modules picked, only the outermost are checkpointed.
        enabled: False returns ``model`` untouched.

    Returns:
        ``model`` itself. Undo with :func:`uncheckpoint_activations`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``names`` is not a name, pattern, class or list.
        ValueError: ``names`` is empty or an entry matches no submodule (the message lists the blocks).
        SpeedupsError: a module picked lies inside or around one that is already checkpointed. Nothing is
            registered when it raises.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> model = checkpoint_activations(model, ["0", "1"])
        >>> checkpointed(model)
        ['0', '1']
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> checkpointed(uncheckpoint_activations(model))
        []
    """
    call = checked_call("checkpoint_activations", model, names, enabled)
    picked = pick_modules(model, names, call)
    if not enabled:
        return model
    done = checkpointed_modules(model)
    for name, module in picked:
        clash = next((n for n, m in done if overlaps(m, module)), None)
        if clash is not None:
            raise SpeedupsError(
                f"{call}: {name!r} lies inside or around {clash!r}, which is already checkpointed; a "
                f"checkpoint inside another recomputes the same activations twice. Call "
                f"uncheckpoint_activations(model) first, then checkpoint the blocks you want in one call."
            )
    _recompile()  # first: a reset also forgets which hook frames dynamo must leave alone
    for name, module in picked:
        if getattr(module, ATTR, None) is None:  # already checkpointed: kept as it is
            setattr(module, ATTR, Recompute(module, name))
    return model


def _recompile() -> None:
    """Drop what ``torch.compile`` compiled, so that the hooks added or removed are seen.

    dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled
    before would run without them. torch's advice after changing hooks is ``torch.compiler.reset()``; it
    costs a recompile at the next call of each compiled function, and nothing if nothing was compiled.
    """
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


def uncheckpoint_activations(model: M, names: NameSpec | None = None) -> M:
    """Undo :func:`checkpoint_activations`: the blocks keep their activations for backward again.

    A backward of a forward run before the undo still recomputes (its graph holds the checkpoint).

    Args:
        model: the model given to :func:`checkpoint_activations` (or its wrapper).
        names: which checkpointed blocks to undo, picked as :func:`checkpoint_activations` picks them (a
            checkpointed block inside a module picked counts as picked). None: every one.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``names`` of the wrong type.
        ValueError: an entry of ``names`` matches no submodule.
    """
    roots = undo_roots(model, names, "uncheckpoint_activations")
    for root in roots:
        for module in root.modules():
            recompute: Recompute | None = getattr(module, ATTR, None)
            if recompute is not None:
                recompute.remove()
                delattr(module, ATTR)
    _recompile()
    return model


def checkpointed(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s checkpointed blocks in ``named_modules()`` order."""
    return [name for name, _ in checkpointed_modules(model)]


def checkpointed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model``'s checkpointed blocks as ``(dotted name, module)``, in ``named_modules()`` order."""
    return [(n, m) for n, m in unwrap(model).named_modules() if getattr(m, ATTR, None) is not None]

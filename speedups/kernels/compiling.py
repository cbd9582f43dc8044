"""Compile by block name: ``torch.compile`` on the repeated blocks of a model, not the whole model.

A model of many identical blocks (a transformer's layers) compiled whole is traced and optimised block by
block, each as new code: minutes of compile time that grow with depth. Compiling each block's call instead
(PyTorch's "regional compilation" recipe) compiles the block's code once and reuses it for every block of the
same class and shapes (dynamo guards on the module, then recompiles only the guards), at the price of a
graph break between blocks. :func:`compile_blocks` does it by the names :func:`checkpoint_activations` takes,
in place and with an undo (:func:`uncompile_blocks`).
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch
from torch import nn

from speedups._helpers import compat
from speedups._helpers.wrappers import unwrap
from speedups.errors import SpeedupsError
from speedups.memory.blocks import NameSpec, checked_call, overlaps, pick_modules, undo_roots

__all__ = ["compile_blocks", "compiled_blocks", "uncompile_blocks"]

M = TypeVar("M", bound=nn.Module)
_ATTR = "_speedups_compile_options"  # on a block compile_blocks compiled: the options it was given


def compile_blocks(model: M, names: NameSpec, *, enabled: bool = True, **options: Any) -> M:
    """Compile the named blocks of ``model`` with ``torch.compile``, in place; the rest runs eagerly.

    Each block picked gets ``block.compile(**options)`` (``nn.Module.compile``: its call, hooks included,
    compiled on the first call; the module, its parameters and its ``state_dict`` keys unchanged, so
    checkpoints load either way). Blocks of one class compile once and reuse the code: PyTorch's regional
    compilation recipe (pytorch.org/tutorials/recipes/regional_compilation.html); cold compile time grows
    with the number of distinct blocks, not with depth. What it costs: a graph break between blocks (the
    code around them runs eagerly), so the step may be a little slower than the whole model compiled
    (``benchmarks/compile.py`` gives both). Composes with ``@accumulate`` (micro-batching too),
    ``mixed_precision``, ``ddp_wrap``, FSDP2 and :func:`~speedups.checkpoint_activations` (on the same blocks:
    the compiled code runs in forward and in the recompute) in either order (names are the plain model's),
    and checkpoints. Sync points: none; the first call of each block compiles (seconds).

    Args:
        model: the model (plain, DDP-wrapped, FSDP2-sharded or compiled); its plain module's blocks are
            compiled in place.
        names: a dotted submodule name, a pattern (``"blocks.*"``, ``"transformer.h.*"``; a ``*`` matches
            one part of a dotted name), a module class, or a list of them, as for
            :func:`~speedups.checkpoint_activations`. Of the modules picked, only the outermost are compiled.
        enabled: False returns ``model`` untouched.
        **options: ``torch.compile``'s keyword arguments (``backend``, ``mode``, ``dynamic``,
            ``fullgraph``, ``options``, ``disable``).

    Returns:
        ``model`` itself. Undo with :func:`uncompile_blocks`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``names`` is not a name, pattern, class or list; an
            option ``torch.compile`` does not take.
        ValueError: ``names`` is empty or an entry matches no submodule (the message lists the blocks).
        SpeedupsError: a block picked is, lies inside or lies around one already compiled: by
            ``compile_blocks`` (undo it with :func:`uncompile_blocks` first), or by hand with
            ``module.compile()``, which ``uncompile_blocks`` does not undo (the message gives the call
            without those blocks). Nothing is compiled when it raises.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> model = compile_blocks(model, ["0", "2"], backend="eager")
        >>> compiled_blocks(model)
        ['0', '2']
        >>> compiled_blocks(uncompile_blocks(model))
        []
    """
    call = checked_call("compile_blocks", model, names, enabled)
    allowed = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"{call}: {unknown[0]}= is not an option of torch.compile; it takes {', '.join(allowed)}. "
            f"Write e.g. compile_blocks(model, 'blocks.*', mode='max-autotune')."
        )
    picked = pick_modules(model, names, call, done="compiled")
    if not enabled:
        return model
    _refuse_compiled(unwrap(model), names, picked, call, options)
    for _, module in picked:
        module.compile(**options)
        setattr(module, _ATTR, dict(options))
    return model


def uncompile_blocks(model: M, names: NameSpec | None = None) -> M:
    """Undo :func:`compile_blocks`: the blocks run eagerly again (their compiled code is dropped).

    Only what :func:`compile_blocks` compiled: a module compiled by hand (``module.compile()``) stays
    compiled (torch has no public undo for it, and an undo here would drop code the user asked for).

    Args:
        model: the model given to :func:`compile_blocks` (or its wrapper).
        names: which compiled blocks to undo, picked as :func:`compile_blocks` picks them (a compiled block
            inside a module picked counts as picked). None: every one.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``names`` of the wrong type.
        ValueError: an entry of ``names`` matches no submodule.
    """
    roots = undo_roots(model, names, "uncompile_blocks", done="compiled")
    for root in roots:
        for module in root.modules():
            if getattr(module, _ATTR, None) is not None:
                compat.uncompile_module(module)
                delattr(module, _ATTR)
    return model


def compiled_blocks(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s blocks that :func:`compile_blocks` compiled, in ``named_modules()``
    order (a deep copy or an unpickled model has none: ``nn.Module`` drops its compiled call then)."""
    return [
        n for n, m in unwrap(model).named_modules() if getattr(m, _ATTR, None) is not None and _compiled(m)
    ]


def _refuse_compiled(
    root: nn.Module, names: NameSpec, picked: list[tuple[str, nn.Module]], call: str, options: dict[str, Any]
) -> None:
    """Refuse blocks that are compiled already, or lie inside or around one that is, with the fix that works:
    :func:`uncompile_blocks` for what :func:`compile_blocks` compiled; for a module compiled by hand
    (``module.compile()``: torch has no public undo, and :func:`uncompile_blocks` leaves what it did not do
    alone), the call without the blocks it clashes with, or that ``compile()`` call left out.

    Raises:
        SpeedupsError: a clash; nothing is compiled.
    """
    done = [(n, m) for n, m in root.named_modules() if _compiled(m)]

    def clash_of(module: nn.Module, among: list[tuple[str, nn.Module]]) -> str | None:
        return next((n for n, m in among if m is module or overlaps(m, module)), None)

    by_hand = [(n, m) for n, m in done if getattr(m, _ATTR, None) is None]
    for name, module in picked:
        hand = clash_of(module, by_hand)
        clash = hand if hand is not None else clash_of(module, done)
        if clash is None:
            continue
        same = root.get_submodule(clash) is module
        where = "is already compiled" if same else f"lies inside or around {clash!r}, which is compiled"
        if hand is None:
            raise SpeedupsError(
                f"{call}: {name!r} {where} by compile_blocks. Call uncompile_blocks(model) first, then "
                f"compile the blocks you want in one call."
            )
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        args = f", {shown}" if shown else ""
        by = "model.compile(...)" if clash == "" else f"model.get_submodule({clash!r}).compile(...)"
        rest = [n for n, m in picked if clash_of(m, by_hand) is None]
        fixes = [f"remove that {by} call and let compile_blocks compile the blocks: compile_blocks(model, "
                 f"{_shown(names, picked)}{args})"]  # fmt: skip
        if rest:
            fixes.insert(0, f"leave it out: compile_blocks(model, {_shown(rest)}{args})")
        raise SpeedupsError(
            f"{call}: {name!r} {where} by its own compile() ({by}, not compile_blocks). uncompile_blocks "
            f"undoes only what compile_blocks compiled, and torch has no public undo for "
            f"nn.Module.compile(); compiling here too would compile one call twice. "
            f"{_sentence('; or '.join(fixes))}."
        )


def _shown(names: NameSpec, picked: list[tuple[str, nn.Module]] | None = None) -> str:
    """Names as a message's code writes them: one name alone; with ``picked``, the names as the user gave
    them where they are strings, else (a class among them) the dotted names picked."""
    given = [names] if isinstance(names, (str, type)) else list(names)
    if picked is not None and not all(isinstance(n, str) for n in given):
        given = [n for n, _ in picked]
    return repr(given[0]) if len(given) == 1 else repr(given)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _compiled(module: nn.Module) -> bool:
    """Whether ``module``'s call is compiled (by :func:`compile_blocks` or ``module.compile()``)."""
    return compat.has_compiled_call(module)

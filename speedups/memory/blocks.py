"""Which submodules are a model's blocks, and which ones a list of names, patterns or classes picks.

A *block* is a unit of a model that activation checkpointing covers whole: the model's children, with the
containers that are never called themselves (``nn.ModuleList``, ``nn.ModuleDict``) opened, so nanoGPT's
blocks are ``transformer.wte``, ..., ``transformer.h.0`` ... ``transformer.h.11``, ``transformer.ln_f`` and
``lm_head``, and a torchvision ResNet's ``conv1``, ..., ``layer1``, ..., ``fc`` (an ``nn.Sequential`` is
called, so it is one block; a model that is an ``nn.Sequential`` has its children as blocks).

Names are matched against the plain model's ``named_modules()`` (inside DDP or ``torch.compile``): a pattern
is a dotted name whose parts may hold ``*``, ``?`` and ``[...]`` (``fnmatch``), each part matching one part of
a name, so ``"blocks.*"`` picks ``blocks.0`` and ``blocks.1`` but not ``blocks.0.attn``. A class picks every
module of that class. Of the modules picked, only the outermost are kept: a checkpoint inside a checkpoint
would recompute the same activations twice (and fail torch's recompute check).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from speedups._helpers.validate import short
from speedups._helpers.wrappers import unwrap

__all__ = ["CONTAINERS", "NameSpec", "checked_call", "model_blocks", "overlaps", "pick_modules", "undo_roots"]

CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called: their hooks would never fire

NameSpec = str | type | Sequence[str | type]


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` (its plain module), in registration order: ``[(dotted name, module)]``.

    A model with no children is one block, named ``""``.
    """
    root = unwrap(model)
    found = list(_open_containers("", root))
    return found or [("", root)]


def _open_containers(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, CONTAINERS) and len(child) > 0:
            yield from _open_containers(full + ".", child)
        else:
            yield full, child


def overlaps(a: nn.Module, b: nn.Module) -> bool:
    """Whether one of two distinct modules lies inside the other: a checkpoint there would be nested."""
    return a is not b and (any(m is b for m in a.modules()) or any(m is a for m in b.modules()))


def _matches(pattern: str, name: str) -> bool:
    parts, wanted = name.split(".") if name else [], pattern.split(".") if pattern else []
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=True)
    )


def pick_modules(
    model: nn.Module, names: Any, call: str, done: str = "checkpointed"
) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` that ``names`` picks, in ``named_modules()`` order (``call``: the
    call as written, for messages; ``done``: what happens to a block picked, "checkpointed", "compiled").

    Raises:
        TypeError: ``names`` is not a string, a module class, or a list of them.
        ValueError: ``names`` is empty, or an entry picks nothing (the message lists the blocks).
    """
    entries = [names] if isinstance(names, (str, type)) else names
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, (str, type)) for e in entries):
        raise TypeError(
            f"{call}: names must be a submodule name or pattern (str), a module class, or a list of them; "
            f"got {short(names)}. Write e.g. {call.split('(')[0]}(model, 'blocks.*') or (model, [Block])."
        )
    bad = [e for e in entries if isinstance(e, type) and not issubclass(e, nn.Module)]
    if bad:
        raise TypeError(
            f"{call}: {bad[0].__name__} is not an nn.Module class. Pass a module class or a name."
        )
    if not entries:
        raise ValueError(f"{call}: names is empty. Name at least one block, e.g. 'blocks.*'.")
    root = unwrap(model)
    every = list(root.named_modules(remove_duplicate=False))
    picked: dict[int, tuple[str, nn.Module]] = {}
    for entry in entries:
        hits = [
            (n, m)
            for n, m in every
            if (isinstance(m, entry) if isinstance(entry, type) else _matches(entry, n))
        ]
        if not hits:
            raise ValueError(
                f"{call}: {short(entry)} matches no submodule of {type(root).__name__}. {_hint(entry, root)}"
            )
        for n, m in hits:
            if isinstance(m, CONTAINERS):
                # the same pick with each container replaced by its modules (its siblings kept)
                names_now = [f"{h}.*" if isinstance(x, CONTAINERS) else h for h, x in hits]
                fix = repr(names_now[0]) if len(names_now) == 1 else repr(names_now)
                raise ValueError(
                    f"{call}: {short(entry)} picks {n!r}, a {type(m).__name__}, which is never called itself "
                    f"(its modules are), so nothing would be {done}. Name its modules: {fix}."
                )
            picked.setdefault(id(m), (n, m))
    inside = {id(sub) for _, m in picked.values() for sub in m.modules() if sub is not m}
    return [(n, m) for n, m in picked.values() if id(m) not in inside]


def checked_call(function: str, model: Any, names: Any, enabled: Any) -> str:
    """``function(model, names)`` as written, for messages, once ``model`` and ``enabled`` are checked.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; ``enabled`` is not a bool.
    """
    shown = type(model).__name__ if isinstance(model, nn.Module) else short(model)
    call = f"{function}({shown}, {short(names)})"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}: model must be an nn.Module, got {type(model).__name__}. Pass your model.")
    if not isinstance(enabled, bool):
        raise TypeError(f"{call}: enabled must be True or False, got {short(enabled)}.")
    return call


def undo_roots(model: nn.Module, names: Any, call: str, done: str = "checkpointed") -> list[nn.Module]:
    """Where an undo looks (``uncheckpoint_activations``, ``uncompile_blocks``): the plain model for
    ``names=None``, else the modules ``names`` picks (:func:`pick_modules`'s rules and errors).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{call}({short(model)}): model must be an nn.Module, got {type(model).__name__}. Pass the model "
            f"you gave {'compile_blocks' if done == 'compiled' else 'checkpoint_activations'}: {call}(model)."
        )
    if names is None:
        return [unwrap(model)]
    return [m for _, m in pick_modules(model, names, f"{call}(model, {short(names)})", done)]


def _hint(entry: str | type, root: nn.Module) -> str:
    blocks = [n for n, _ in model_blocks(root) if n]
    if isinstance(entry, type):
        classes = sorted({type(m).__name__ for _, m in model_blocks(root)})
        return f"Its blocks are of the classes {', '.join(classes)}."
    names = [n for n, _ in root.named_modules() if n]
    if "*" in entry:  # a pattern: suggest the patterns that pick each module's siblings ('blocks.*')
        names = sorted({n.rsplit(".", 1)[0] + ".*" for n in names if "." in n})
    close = difflib.get_close_matches(entry, names, n=3)
    shown = ", ".join(repr(b) for b in blocks[:8]) + (", ..." if len(blocks) > 8 else "")
    near = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"Its blocks are {shown}; a '*' matches one part of a dotted name.{near}"

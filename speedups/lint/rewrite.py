"""``--diff`` and ``--write``: the mechanical upgrades of a script, as a unified diff (formatting kept).

Only what needs no judgement is rewritten, in place, span by span on the source text (the syntax tree gives
each span; the lines around stay as they were, comments included):

- ``DataLoader(dataset, batch_size, ...)`` the lint finds slow becomes ``fast_loader(dataset, batch_size,
  ...)`` (its other keywords passed on; ``num_workers=0`` dropped, so workers are chosen): the same batches
  in the same order, the sampler drawing its seed from the same generator;
- ``x, y = x.to(device), y.to(device)`` (any tensors, one device) once per step or batch becomes
  ``x, y = to_device((x, y), device)``;
- ``from speedups import ...`` for what the rewrites use, after the script's last top-level import.

Everything else a finding names (``@accumulate`` around a step body, ``LossTracker`` for a running sum,
``mixed_precision``) needs a person: the code is left alone and the finding says what to write.
"""

from __future__ import annotations

import ast
import difflib
import os
import shutil
import sys
from pathlib import Path
from typing import TextIO

from speedups.lint.report import files_of
from speedups.lint.rules import loaders
from speedups.lint.script import Script, dotted

__all__ = ["rewrite_paths", "rewrite_source"]


def rewrite_source(source: str) -> str:
    """``source`` with the mechanical upgrades applied (unchanged when none applies).

    Raises:
        SyntaxError: the source does not parse.
    """
    script = Script("<script>", source)
    tree = script.tree
    slow_loaders = {line for line, _, _ in loaders(script)}  # a loader already right is left as it is
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode("utf-8")))
    data = source.encode("utf-8")
    edits: list[tuple[int, int, bytes]] = []  # (start, end, new bytes) in the encoded source
    used: set[str] = set()

    def span(node: ast.AST) -> tuple[int, int]:
        return (offsets[node.lineno - 1] + node.col_offset,  # type: ignore[attr-defined]
                offsets[node.end_lineno - 1] + node.end_col_offset)  # type: ignore[attr-defined]  # fmt: skip

    def text(node: ast.AST) -> str:
        start, end = span(node)
        return data[start:end].decode("utf-8")

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and dotted(node.func).split(".")[-1] == "DataLoader"
            and len(node.args) <= 2
            and node.lineno in slow_loaders
        ):
            if any(k.arg is None for k in node.keywords):
                continue  # **kwargs: what it holds is not known here
            edits.append((*span(node.func), b"fast_loader"))
            edits += _realigned(lines, offsets, node, len("fast_loader") - len(text(node.func)))
            for i, k in enumerate(node.keywords):
                if k.arg == "num_workers" and isinstance(k.value, ast.Constant) and k.value.value == 0:
                    start, end = span(k)
                    prev_end = (
                        span(node.keywords[i - 1])[1] if i else span(node.args[-1])[1] if node.args else None
                    )
                    if prev_end is not None:  # ", num_workers=0" goes with the comma before it
                        edits.append((prev_end, end, b""))
                    else:
                        nxt = span(node.keywords[i + 1])[0] if i + 1 < len(node.keywords) else end
                        edits.append((start, nxt, b""))
            used.add("fast_loader")
        elif (
            isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.targets) == 1
            and script.per_batch(node)  # where the lint says so: a copy once per step or batch
        ):  # fmt: skip
            moved = [_moved(e) for e in node.value.elts]
            if len(moved) > 1 and all(m is not None for m in moved):
                devices = {ast.dump(m[1]) for m in moved}  # type: ignore[index]
                if len(devices) == 1:
                    tensors = ", ".join(text(m[0]) for m in moved)  # type: ignore[index]
                    device = text(moved[0][1])  # type: ignore[index]
                    edits.append((*span(node.value), f"to_device(({tensors}), {device})".encode()))
                    used.add("to_device")
    if not edits:
        return source
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    after = offsets[imports[-1].end_lineno] if imports else 0  # type: ignore[index]
    edits.append((after, after, f"from speedups import {', '.join(sorted(used))}\n".encode()))
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        data = data[:start] + new + data[end:]
    return data.decode("utf-8")


def _realigned(
    lines: list[str], offsets: list[int], call: ast.Call, delta: int
) -> list[tuple[int, int, bytes]]:
    """Edits that keep a call's continuation lines aligned with its opening parenthesis when its name grows
    by ``delta`` characters (lines indented to the column after the ``(``; other indentation is left)."""
    paren = call.func.end_col_offset or 0
    first = lines[call.lineno - 1]
    if delta <= 0 or paren >= len(first) or first[paren] != "(" or not first[paren + 1 :].strip():
        return []  # nothing after "(" on its line: the arguments are indented by block, not aligned
    edits = []
    for number in range(call.lineno + 1, (call.end_lineno or call.lineno) + 1):
        line = lines[number - 1]
        if len(line) - len(line.lstrip(" ")) == paren + 1:
            edits.append((offsets[number - 1], offsets[number - 1], b" " * delta))
    return edits


def _moved(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``(tensor, device)`` of ``tensor.to(device)`` (no other argument), else None."""
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
        and len(node.args) == 1 and not node.keywords
    ):  # fmt: skip
        return node.func.value, node.args[0]
    return None


def rewrite_paths(paths: list[str], *, write: bool = False, out: TextIO = sys.stdout) -> int:
    """Print the unified diff of every file's upgrades (``patch -p1`` applies it from the current folder);
    with ``write``, apply them, keeping each changed file as ``FILE.orig``. Returns how many files change."""
    changed = 0
    for path in paths:
        for file in files_of(path):
            try:
                before = Path(file).read_text(encoding="utf-8")
                after = rewrite_source(before)
            except (SyntaxError, OSError, UnicodeDecodeError):
                continue  # said by the check already
            if after == before:
                continue
            changed += 1
            name = os.path.relpath(file) if os.path.isabs(file) else os.path.normpath(file)
            out.writelines(difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{name}", f"b/{name}"
            ))  # fmt: skip
            if write:
                shutil.copy2(file, f"{file}.orig")
                Path(file).write_text(after, encoding="utf-8")
    return changed

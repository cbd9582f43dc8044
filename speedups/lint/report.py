"""Check files and folders and print the findings (``python -m speedups.lint``'s body)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import TextIO

from speedups.lint.finding import TOPICS, Finding
from speedups.lint.rules import findings
from speedups.lint.script import Script

__all__ = ["lint_paths", "lint_source", "files_of", "summary"]


def lint_source(source: str, path: str = "<script>") -> list[Finding]:
    """The findings for one script's source (read, never imported or run).

    Raises:
        SyntaxError: the source does not parse.
    """
    return findings(Script(path, source))


def files_of(path: str) -> list[str]:
    """``path`` if a file; its ``.py`` files (sorted; hidden, cache and virtual-environment folders left
    out) if a folder, named from the path as given (``examples`` -> ``examples/train.py``)."""
    root = Path(path)
    if not root.is_dir():
        return [path]
    skip = {"venv", "site-packages", "__pycache__", "node_modules"}
    return [
        str(file) for file in sorted(root.rglob("*.py"))
        if not any(p in skip or p.startswith(".") for p in file.relative_to(root).parts[:-1])
    ]  # fmt: skip


def lint_paths(
    paths: list[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> tuple[int, list[Finding]]:
    """Check every file (and every ``.py`` under every folder) of ``paths``; print one line a finding, then
    a summary. Returns the exit status (0: nothing applies, 1: something does, 2: a file could not be read or
    parsed, the others still checked) and the findings."""
    found: list[Finding] = []
    failed = 0
    for path in paths:
        for file in files_of(path):
            try:
                source = Path(file).read_text(encoding="utf-8")
                found += lint_source(source, file)
            except SyntaxError as e:
                failed += 1
                err.write(f"{file}:{e.lineno}: cannot parse it ({e.msg}); the other files were checked\n")
            except (OSError, UnicodeDecodeError) as e:
                failed += 1
                err.write(f"{file}: cannot read it ({type(e).__name__}: {e}); the other files were checked\n")
    for finding in found:
        out.write(f"{finding}\n")
    out.write(summary(found, failed) + "\n")
    return (2 if failed else 1 if found else 0), found


def summary(found: list[Finding], failed: int = 0) -> str:
    """One paragraph: which tips and topics apply, how often, in the tips' order (``failed``: files that
    could not be read or parsed, said first)."""
    unread = f"{failed} file{'s' if failed > 1 else ''} could not be read (above); " if failed else ""
    if not found:
        return f"speedups.lint: {unread}nothing to change in {'the others' if failed else 'these scripts'}."
    counts = Counter(f.topic for f in found)
    order = [t for t in TOPICS if t in counts]
    parts = [f"{'tip ' + t if t.isdigit() else t} ({TOPICS[t][0]}) x{counts[t]}" for t in order]
    files = len({f.path for f in found})
    return (
        f"speedups.lint: {unread}{len(found)} place{'s' if len(found) > 1 else ''} in {files} "
        f"file{'s' if files > 1 else ''}: {', '.join(parts)}. `--diff` shows the mechanical upgrades."
    )

"""The code blocks of a Markdown page, and running one as a script: shared by the README's and docs/' tests.

A block is a fence at the start of a line: ```` ```python ```` up to the next ```` ``` ````, the same
expression ``tests/test_package.py`` uses for the README. A block runs as a file of its own in a fresh
interpreter, from the repository root (so ``examples/`` and ``benchmarks/`` paths resolve), as a user who
pastes it into ``file.py`` runs it; one that starts processes (``ddp_wrap``, ``init_distributed``) also
runs under ``torchrun`` with 2 processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", flags=re.S)
FENCE_OPENING = re.compile(r"^([ \t]*)```(\S*)", flags=re.M)
TORCHRUN_CALLS = ("ddp_wrap(", "init_distributed(")


def python_blocks(text: str) -> list[str]:
    """The ```` ```python ```` blocks of ``text``, in order, without their fences."""
    return PYTHON_BLOCK.findall(text)


def fence_languages(text: str) -> list[tuple[str, str]]:
    """``(indent, language)`` of every fence that opens a block in ``text`` (closing fences left out)."""
    found, inside = [], False
    for match in FENCE_OPENING.finditer(text):
        if not inside:
            found.append((match.group(1), match.group(2)))
        inside = not inside
    return found


def runs_under_torchrun(block: str) -> bool:
    """Whether ``block`` starts a process group, so that it also runs with 2 processes."""
    return any(call in block for call in TORCHRUN_CALLS)


def run_block(block: str, script: Path, *, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Write ``block`` to ``script`` and run it with this interpreter, from the repository root."""
    script.write_text(block)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def run_block_under_torchrun(
    block: str, script: Path, *, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Write ``block`` to ``script`` and run it with ``torchrun --nproc-per-node nproc`` on 127.0.0.1."""
    from tests._dist import run_torchrun

    script.write_text(block)
    return run_torchrun(script, nproc=nproc, timeout=timeout)

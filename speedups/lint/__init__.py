"""``python -m speedups.lint train.py``: which tips a training script needs, where, before it runs.

Reads the source only (``ast``, standard library; nothing is imported or run): one finding per place,
``path:line: tip N (name): what it costs and what to write instead [docs page]``, then a summary; ``--diff``
prints the mechanical upgrades as a unified diff, ``--write`` applies them (each file kept as ``.orig``).
The rules are in :mod:`speedups.lint.rules`, each with its reasoning.

Three ways to ask which tip applies: the doctor (``python -m speedups.doctor``) says what this machine
offers each tip; the lint says what this script does about them, before it runs; ``check(...)`` and
``profile_steps`` measure the running loop.
"""

from __future__ import annotations

from speedups.lint.finding import TOPICS, Finding
from speedups.lint.report import lint_paths, lint_source
from speedups.lint.rewrite import rewrite_source

__all__ = ["TOPICS", "Finding", "lint_paths", "lint_source", "rewrite_source"]

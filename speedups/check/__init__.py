"""``python -m speedups.check train.py``: which tips a training script needs, where, before it runs.

Reads the source only (``ast``, standard library; nothing is imported or run): one finding per place,
``path:line: tip N (name): what it costs and what to write instead [docs page]``, then a summary; ``--diff``
prints the mechanical upgrades as a unified diff, ``--write`` applies them (each file kept as ``.orig``).
The rules are in :mod:`speedups.check.rules`, each with its reasoning.

The doctor (``python -m speedups.doctor``) says what this machine offers each tip; the check says what this
script does about them; ``profile_steps``/``check(...)`` measure a running loop.

``speedups.check`` stays the runtime check of a running loop (:func:`speedups.profiling.check`): importing
this module, as ``python -m`` does, binds it on the package in that function's place, so the module calls
through to it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from speedups.check.finding import TOPICS, Finding
from speedups.check.report import check_paths, check_source
from speedups.check.rewrite import rewrite_source

__all__ = ["TOPICS", "Finding", "check_paths", "check_source", "rewrite_source"]


class _CallsTheRuntimeCheck(types.ModuleType):
    """This module, callable as :func:`speedups.profiling.check` (which ``speedups.check`` names)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from speedups.profiling import check

        return check(*args, **kwargs)


sys.modules[__name__].__class__ = _CallsTheRuntimeCheck

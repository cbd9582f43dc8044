"""Where the user's code is: the first frame outside speedups and torch, for a warning to point at
(:func:`user_stacklevel`) or a message to name (:func:`user_line`)."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_line", "user_stacklevel"]

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this function, name the
    user's line: the nearest frame whose file is neither in the speedups package nor in torch (the user
    stepping an optimizer runs torch's step wrapper before a hook of ours). Walks a few frames; meant for
    the rare path that warns, not the hot one."""
    frame = sys._getframe(1)  # the function that will call warnings.warn (stacklevel 1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_OURS) or name.startswith(_TORCH)):
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return 1


def user_line() -> str:
    """Where the user's code made the call that runs this: ``"file:line"`` of the nearest frame whose file is
    neither in speedups nor in torch, the file relative to the working directory when it lies inside it
    (``"train.py:12"``), else as Python names it. Walks a few frames; meant for a call made once (a switch
    being made), not the hot path."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_OURS) or name.startswith(_TORCH)):
            return f"{_shown_path(name)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def _shown_path(name: str) -> str:
    """A code file's name as a message shows it: relative to the working directory when inside it."""
    if not os.path.isabs(name):
        return name  # "<stdin>", "<doctest ...>", or already relative
    try:
        relative = os.path.relpath(name)
    except ValueError:  # another drive (Windows)
        return name
    return name if relative.startswith(os.pardir + os.sep) else relative

"""Where a warning about the user's code should point: the first frame outside speedups and torch."""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["user_stacklevel"]

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

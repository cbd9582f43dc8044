"""A note on an exception that passes through: what speedups did about it, read under its traceback."""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(error: BaseException, text: str) -> None:
    """Add ``text`` under ``error``'s message (``BaseException.add_note``, Python 3.11+; a no-op before)."""
    adding = getattr(error, "add_note", None)
    if adding is not None:
        adding(text)

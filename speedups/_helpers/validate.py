"""Argument checks shared by every public call, with the call's context added once.

Each check raises ``TypeError`` (wrong kind) or ``ValueError`` (right kind, out of range) whose message names
the argument, the value given, what is allowed and the fix (``Write batch_size=64.``). Wrapping the checks
of one call in :func:`arguments` puts the call as written in front of every such message, once, as einops
does with its pattern and shapes::

    with validate.arguments(f"fast_loader(batch_size={batch_size!r})"):
        batch_size = validate.integer(batch_size, "batch_size", minimum=1, none_ok=True, example="64")

raises ``ValueError("fast_loader(batch_size=0): batch_size=0 must be an int >= 1 or None. Write
batch_size=64.")``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from typing import Any

__all__ = ["arguments", "flag", "instance", "integer", "real", "short"]

_PREFIXED = "_speedups_call"


def short(value: object, limit: int = 60) -> str:
    """``repr(value)`` on one line, cut to ``limit`` characters: how error messages quote a user's object."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def arguments(call: str) -> Iterator[None]:
    """Prefix every ``TypeError``/``ValueError`` raised inside with ``call`` (the call as written), once.

    An error already prefixed (by an inner ``arguments`` block) passes through unchanged.
    """
    try:
        yield
    except (TypeError, ValueError) as error:
        if getattr(error, _PREFIXED, False) or len(error.args) != 1 or not isinstance(error.args[0], str):
            raise
        new = type(error)(f"{call}: {error.args[0]}")
        setattr(new, _PREFIXED, True)
        raise new from error.__cause__


def _fix(name: str, example: str | None) -> str:
    return f" Write {name}={example}." if example is not None else ""


def flag(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool; else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        kind = type(value)
        got = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name}={short(value)}: expected True or False, got {got}.")
    return value


def integer_or_auto(value: object, call: str, *, expected: str, unit: str, fix: str) -> None:
    """Check an option that is an int >= 1 (in ``unit``) or ``"auto"``; None is the caller's to handle.

    Raises:
        ValueError: another string, or an int < 1. TypeError: any other type (a bool too), said as
            ``expected {expected}``. Each message starts with ``call`` and ends with ``fix``.
    """
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{call}: the only string allowed is 'auto'. {fix}")
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{call}: expected {expected}, got {type(value).__name__}. {fix}")
    elif value < 1:
        raise ValueError(f"{call}: must be >= 1 ({unit}). {fix}")


def integer(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    none_ok: bool = False,
    example: str | None = None,
) -> Any:
    """Return ``value`` if it is an int (never a bool) in ``[minimum, maximum]``, or None when ``none_ok``.

    Raises:
        TypeError: not an int (bools are refused: ``True`` is not a count).
        ValueError: out of range.
    """
    if value is None and none_ok:
        return None
    allowed = "an int" + (f" >= {minimum}" if minimum is not None else "")
    allowed += f" and <= {maximum}" if maximum is not None else ""
    allowed += " or None" if none_ok else ""
    if isinstance(value, bool) or not isinstance(value, int):
        got = type(value).__name__
        raise TypeError(f"{name}={short(value)}: expected {allowed}, got {got}.{_fix(name, example)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={short(value)}: must be {allowed}.{_fix(name, example)}")
    return value


def real(
    value: Any,
    name: str,
    *,
    positive: bool = False,
    non_negative: bool = False,
    finite: bool = True,
    none_ok: bool = False,
    example: str | None = None,
) -> float | None:
    """Return ``value`` as a float if it is a real number (never a bool) within the asked range.

    Numbers too large for a float count as infinite.

    Raises:
        TypeError: not a real number.
        ValueError: not finite (when ``finite``), not > 0 (``positive``) or not >= 0 (``non_negative``).
    """
    if value is None and none_ok:
        return None
    kind = "a positive" if positive else "a non-negative" if non_negative else "a"
    allowed = f"{kind}{' finite' if finite else ''} number" + (" or None" if none_ok else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        got = type(value).__name__
        raise TypeError(f"{name}={short(value)}: expected {allowed}, got {got}.{_fix(name, example)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if (
        math.isnan(number)
        or (finite and math.isinf(number))
        or (positive and number <= 0)
        or (non_negative and number < 0)
    ):
        raise ValueError(f"{name}={short(value)}: must be {allowed}.{_fix(name, example)}")
    return number


def instance(
    value: Any, types: type | tuple[type, ...], name: str, *, what: str, none_ok: bool = False
) -> Any:
    """Return ``value`` if it is an instance of ``types`` (or None when ``none_ok``); else ``TypeError``.

    ``what`` says in words what is expected (``"a torch.optim.Optimizer"``).
    """
    if (value is None and none_ok) or isinstance(value, types):
        return value
    shown = short(value)
    allowed = what + (" or None" if none_ok else "")
    raise TypeError(f"{name}={shown}: expected {allowed}, got {type(value).__name__}.")

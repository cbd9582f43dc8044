"""Which kernel switches are in force in this process, so that opposite ones refuse each other, and each is
restored in the order it was made.

``deterministic()`` and ``fast_kernels()`` set the same process-wide torch flags in opposite directions
(``torch.backends.cudnn.benchmark`` first of all): one made while the other is in force would undo it
silently. Each switch says here when it takes effect and when it is restored; the other asks before it
changes anything.

Switches of one kind nest (each keeps what it found when it was made, and puts that back), so they must be
restored newest first: an older one restored while a newer one is in force would put back its findings
under the newer one, and the newer one's restore would then put back what the older one had set (seen:
``torch.use_deterministic_algorithms`` left on after both restores). :func:`check_order` refuses that,
before the switch changes anything. Process-wide like the flags themselves (not per thread or task).
"""

from __future__ import annotations

from collections.abc import Callable

from speedups._helpers.validate import short
from speedups.errors import SpeedupsError

__all__ = ["check_order", "enter", "find", "leave", "not_a_decorator"]

_IN_FORCE: list[tuple[str, object, str]] = []  # (kind, switch, the call that made it), oldest first


def enter(kind: str, switch: object, said: str) -> None:
    """Record that ``switch`` (a ``kind`` switch, e.g. ``"deterministic"``; ``said``: the call that made it)
    has taken effect."""
    _IN_FORCE.append((kind, switch, said))


def leave(switch: object) -> None:
    """Record that ``switch`` was restored; a switch not recorded is ignored."""
    for index, (_, held, _) in enumerate(_IN_FORCE):
        if held is switch:
            del _IN_FORCE[index]
            return


def find(kind: str) -> object | None:
    """Return the newest ``kind`` switch in force, or None."""
    for held_kind, switch, _ in reversed(_IN_FORCE):
        if held_kind == kind:
            return switch
    return None


def check_order(switch: object, said: str) -> None:
    """Refuse to restore ``switch`` (made by the call ``said``) while a switch made after it is in force.

    Raises:
        SpeedupsError: a newer switch is in force; the message names both and the order to restore them.
    """
    mine = next((i for i, (_, held, _) in enumerate(_IN_FORCE) if held is switch), None)
    if mine is None or mine == len(_IN_FORCE) - 1:
        return
    newer = [call for _, _, call in _IN_FORCE[mine + 1 :]]
    what = f"{newer[0]} was" if len(newer) == 1 else f"{len(newer)} switches were, the newest {newer[-1]},"
    raise SpeedupsError(
        f"{said}.restore(): {what} made after it and still in force. Each switch puts back what it found "
        f"when it was made, so in this order the settings would end as the newer switch found them (this "
        f"one's), not as they were before both; nothing was changed. Restore switches newest first: "
        f"newer.restore() (or leave its with block), then this one's restore()."
    )


def not_a_decorator(
    switch: object, said: str, target: object, restore: Callable[[], None], fix: str
) -> TypeError:
    """The error for a switch used as a decorator (``@deterministic(seed=0)``: the switch called with the
    function ``target``), after putting back what the switch changed when it was made, if it is the newest.

    The switch took effect when the decorator line made it, before it could see the function; ``fix`` is the
    right spelling, as code.
    """
    mine = next((i for i, (_, held, _) in enumerate(_IN_FORCE) if held is switch), None)
    if mine is None:
        done = "Nothing is in force"
    elif mine == len(_IN_FORCE) - 1:
        restore()
        done = "What it changed when it was made is put back"
    else:
        done = "It stays in force, since switches made after it are (restore them first, then it)"
    name = getattr(target, "__qualname__", None) or short(target)
    return TypeError(
        f"@{said} on {name}: a switch is not a decorator. It takes effect when it is made (here when the "
        f"decorator line ran, for the whole process, not around each call) and is restored by restore() or "
        f"a with block. {done}. Write it inside the function: {fix}"
    )

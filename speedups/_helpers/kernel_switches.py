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

Two switches made alike read the same (``deterministic(seed=0, ...)`` twice), so each is also named by where
the user's code made it (``train.py:12``, :func:`~speedups._helpers.callers.user_line`, read when it is
made) and by its order among those in force.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from speedups._helpers.validate import short
from speedups.errors import SpeedupsError

__all__ = ["check_order", "enter", "find", "leave", "made_at", "not_a_decorator"]


class _Held(NamedTuple):
    kind: str
    switch: object
    said: str  # the call that made it, as written
    where: str  # where the user's code made it: "train.py:12"


_IN_FORCE: list[_Held] = []  # oldest first


def enter(kind: str, switch: object, said: str, where: str) -> None:
    """Record that ``switch`` (a ``kind`` switch, e.g. ``"deterministic"``; ``said``: the call that made it;
    ``where``: the user's ``file:line`` that made it) has taken effect."""
    _IN_FORCE.append(_Held(kind, switch, said, where))


def leave(switch: object) -> None:
    """Record that ``switch`` was restored; a switch not recorded is ignored."""
    for index, held in enumerate(_IN_FORCE):
        if held.switch is switch:
            del _IN_FORCE[index]
            return


def find(kind: str) -> object | None:
    """Return the newest ``kind`` switch in force, or None."""
    for held in reversed(_IN_FORCE):
        if held.kind == kind:
            return held.switch
    return None


def made_at(switch: object) -> str:
    """Where the user's code made ``switch``, a switch in force (``"train.py:12"``); ``"?"`` for one that is
    not."""
    held = next((h for h in _IN_FORCE if h.switch is switch), None)
    return "?" if held is None else held.where


def _index(switch: object) -> int | None:
    return next((i for i, held in enumerate(_IN_FORCE) if held.switch is switch), None)


def check_order(switch: object, said: str) -> None:
    """Refuse to restore ``switch`` (made by the call ``said``) while a switch made after it is in force.

    Raises:
        SpeedupsError: a newer switch is in force; the message names each by the call, where the user's
            code made it and its order, and gives the order to restore them.
    """
    mine = _index(switch)
    if mine is None or mine == len(_IN_FORCE) - 1:
        return
    this, newer = _IN_FORCE[mine], _IN_FORCE[mine + 1 :]
    if len(newer) == 1:
        what = f"the one made at {newer[0].where} (newer), {newer[0].said}, is still in force"
        first = f"the one made at {newer[0].where} (its restore(), or the end of its with block)"
    else:
        places = " and ".join(held.where for held in newer)
        what = f"{len(newer)} made after it are still in force, at {places} (newest: {newer[-1].said})"
        order = ", then ".join(held.where for held in reversed(newer))
        first = f"the ones made at {order} (each one's restore(), or the end of its with block)"
    raise SpeedupsError(
        f"{said}.restore(), on the one made at {this.where} (older): {what}. Each switch puts back what it "
        f"found when it was made, so in this order the settings would end as the newer switch found them "
        f"(this one's), not as they were before both; nothing was changed. Restore switches newest first: "
        f"{first}, then the one made at {this.where}."
    )


def not_a_decorator(
    switch: object, said: str, target: object, restore: Callable[[], None], fix: str
) -> TypeError:
    """The error for a switch used as a decorator (``@deterministic(seed=0)``: the switch called with the
    function ``target``), after putting back what the switch changed when it was made, if it is the newest.

    The switch took effect when the decorator line made it, before it could see the function; ``fix`` is the
    right spelling, as code.
    """
    mine = _index(switch)
    if mine is None:
        done = "Nothing is in force"
    elif mine == len(_IN_FORCE) - 1:
        restore()
        done = "What it changed when it was made is put back"
    else:
        places = ", ".join(held.where for held in reversed(_IN_FORCE[mine + 1 :]))
        done = (
            f"It stays in force (made at {_IN_FORCE[mine].where}), since switches made after it are (at "
            f"{places}: restore them first, newest first, then it)"
        )
    name = getattr(target, "__qualname__", None) or short(target)
    return TypeError(
        f"@{said} on {name}: a switch is not a decorator. It takes effect when it is made (here when the "
        f"decorator line ran, for the whole process, not around each call) and is restored by restore() or "
        f"a with block. {done}. Write it inside the function: {fix}"
    )

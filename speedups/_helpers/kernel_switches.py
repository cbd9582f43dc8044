"""Which kernel switches are in force in this process, so that opposite ones refuse each other.

``deterministic()`` and ``fast_kernels()`` set the same process-wide torch flags in opposite directions
(``torch.backends.cudnn.benchmark`` first of all): one made while the other is in force would undo it
silently, and restoring them out of order would leave neither's flags. Each switch says here when it takes
effect and when it is restored; the other asks before it changes anything. Process-wide like the flags
themselves (not per thread or task).
"""

from __future__ import annotations

__all__ = ["enter", "find", "leave"]

_IN_FORCE: list[tuple[str, object]] = []  # (kind, switch), oldest first


def enter(kind: str, switch: object) -> None:
    """Record that ``switch`` (a ``kind`` switch, e.g. ``"deterministic"``) has taken effect."""
    _IN_FORCE.append((kind, switch))


def leave(switch: object) -> None:
    """Record that ``switch`` was restored; a switch not recorded is ignored."""
    for index, (_, held) in enumerate(_IN_FORCE):
        if held is switch:
            del _IN_FORCE[index]
            return


def find(kind: str) -> object | None:
    """Return the newest ``kind`` switch in force, or None."""
    for held_kind, switch in reversed(_IN_FORCE):
        if held_kind == kind:
            return switch
    return None

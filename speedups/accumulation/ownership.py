"""Which parameters each live ``@accumulate`` step owns, so that no step's window holds another's gradients.

A step owns the parameters of its optimizers. In a script with several steps (a GAN's ``d_step`` and
``g_step``), one step's backward can reach another's parameters: the generator's loss runs through the
discriminator and leaves gradients on it, which the discriminator's next window would add to its own. The
hand-written loop drops them with ``netD.zero_grad()`` at the top of each iteration (pytorch/examples'
``dcgan/main.py``). Here each step sets those parameters' gradients aside while it runs and puts them back
after, so whatever its backward left on them is dropped and an open window there stays as it was.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

__all__ = ["Ownership", "OWNERSHIP"]


class _Owner(Protocol):
    pending: int

    def trainable(self) -> list[torch.Tensor]: ...
    def owned_ids(self) -> set[int]: ...


class Ownership:
    """The live steps, held weakly; a registry shared by every step of the process (:data:`OWNERSHIP`)."""

    def __init__(self) -> None:
        self._steps: weakref.WeakSet[_Owner] = weakref.WeakSet()

    def add(self, step: _Owner) -> None:
        """Register ``step`` (it leaves when it is collected)."""
        self._steps.add(step)

    def foreign_to(self, step: _Owner) -> list[torch.Tensor]:
        """The parameters other live steps own and ``step`` does not (none in a one-step script: O(1))."""
        if len(self._steps) < 2:
            return []
        own = step.owned_ids()
        foreign: dict[int, torch.Tensor] = {}
        for other in list(self._steps):
            if other is not step:
                for p in other.trainable():
                    if id(p) not in own:
                        foreign.setdefault(id(p), p)
        return list(foreign.values())

    def in_open_windows(self, step: _Owner) -> set[int]:
        """The ids of parameters ``step`` shares with other live steps whose windows are open."""
        return {
            id(p)
            for other in list(self._steps)
            if other is not step and other.pending
            for p in other.trainable()
        }


OWNERSHIP = Ownership()
"""The one registry of the process (steps are made in one process and never pickled)."""

"""Which parameters each live ``@accumulate`` step owns, so that no step's window holds another's gradients.

A step owns the parameters of its optimizers. In a script with several steps (a GAN's ``d_step`` and
``g_step``), one step's backward can reach another's parameters: the generator's loss runs through the
discriminator and leaves gradients on it, which the discriminator's window would add to its own. The
hand-written loop drops them with ``netD.zero_grad()`` at the top of each iteration (pytorch/examples'
``dcgan/main.py``). Here:

- a step whose window is open is protected: while another step runs, the open window's gradients are set
  aside and put back after, so whatever that step's backward left there is dropped;
- a step whose window is closed holds no gradient; what another step's backward leaves on it is found when
  its next window starts, and dropped without a word, since another step ran in between (:attr:`last`).

A one-step script pays nothing here: while a step is the process's only live one (:meth:`Guard.set_alone`),
its windows are not registered at all; the steps still alive are told when a second one is made.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

__all__ = ["OWNERSHIP", "Ownership"]


class _Owner(Protocol):
    token: int
    params: Any  # the step's StepParameters: its optimizers
    owner: Any  # the step's accumulator: its function, counters

    def known_params(self) -> list[torch.Tensor]: ...
    def name(self) -> str: ...
    def owned_ids(self) -> set[int]: ...
    def set_alone(self, alone: bool) -> None: ...


class Ownership:
    """The live steps and those with an open window, held weakly; one per process (:data:`OWNERSHIP`).

    Attributes:
        last: the token of the step whose call ran last (each call of a step stores its token, but a step
            alone, whose short path stores none; a step that finds another's there knows another step ran
            since its own last call), None before any call.
    """

    def __init__(self) -> None:
        self._steps: weakref.WeakSet[_Owner] = weakref.WeakSet()
        self._refs: dict[int, weakref.ref[_Owner]] = {}  # id(step) -> the step, weakly: made once
        self._open: dict[int, weakref.ref[_Owner]] = {}  # id(step) -> the step, weakly: open windows
        self._foreign: dict[int, list[torch.Tensor]] = {}  # id(step) -> what it sets aside, until changed
        # id(step) -> (its name, pending, every, {id(p): weakref to p}): the open windows of retired steps
        self.abandoned: dict[int, tuple[str, int, int, dict[int, weakref.ref[torch.Tensor]]]] = {}
        self.last: int | None = None
        self.open_count = 0  # steps with an open window (a step that died open: until it is collected)

    def add(self, step: _Owner) -> None:
        """Register ``step`` (it leaves when it is collected); tell every live step whether it is alone."""
        self._steps.add(step)
        self._refs[id(step)] = weakref.ref(step)
        weakref.finalize(step, self._gone, id(step)).atexit = False
        self._tell_alone()

    def retire(self, step: _Owner, pending: int) -> None:
        """``step``'s handle is gone (its accumulator may live on): it leaves the registry now. An open
        window of ``pending`` calls it leaves is remembered (its parameters weakly), for the next step that
        finds its gradients."""
        key = id(step)
        self._steps.discard(step)
        if pending:
            held = {id(p): weakref.ref(p) for p in step.known_params()}
            self.abandoned[key] = (step.name(), pending, step.owner.every, held)
        self._gone(key)

    def abandoned_on(self, params: list[torch.Tensor]) -> tuple[str, int, int] | None:
        """Forget, and return as ``(name, pending, every)``, a retired step's window that left gradients on
        some of ``params``; None when none did. Windows whose parameters are all gone are forgotten."""
        found = None
        for key, (name, pending, every, held) in list(self.abandoned.items()):
            if not any(ref() is not None for ref in held.values()):
                del self.abandoned[key]
            elif found is None and any((ref := held.get(id(p))) is not None and ref() is p for p in params):
                del self.abandoned[key]
                found = name, pending, every
        return found

    def _gone(self, key: int) -> None:
        self._open.pop(key, None)
        self._refs.pop(key, None)
        self.open_count = len(self._open)
        self.changed()
        self._tell_alone()

    def _tell_alone(self) -> None:
        """Tell each live step whether it is the only one (alone, it registers no window: no other step
        sets its gradients aside, and it sets aside none)."""
        steps = list(self._steps)
        for step in steps:
            step.set_alone(len(steps) == 1)

    def opened(self, step: _Owner) -> None:
        """``step`` holds gradients of an open window (or gradients it gave, DDP after a flush).

        Called once a window (a dict entry): the step calls it only when its window was closed.
        """
        key = id(step)
        self._open[key] = self._refs[key]
        self.open_count = len(self._open)
        if self._foreign:
            self._foreign.clear()

    def closed(self, step: _Owner) -> None:
        """``step``'s window was applied or dropped: its parameters hold no gradient."""
        if self._open.pop(id(step), None) is not None:
            self.open_count = len(self._open)
            if self._foreign:
                self._foreign.clear()

    def changed(self) -> None:
        """Forget what was computed: a window opened or closed, a step went, or one's parameters changed."""
        self._foreign.clear()

    def foreign_to(self, step: _Owner) -> list[torch.Tensor]:
        """The parameters of other steps' open windows that ``step`` does not own: what it sets aside while
        it runs. ``[]`` (one check) when no other window is open; cached until something changes."""
        opened = self._others_open(step)
        if not opened:
            return []
        found = self._foreign.get(id(step))
        if found is not None:
            return found
        own = step.owned_ids()
        foreign: dict[int, torch.Tensor] = {}
        for other in opened:
            for p in other.known_params():  # as that step last saw them: no check runs here
                if id(p) not in own:
                    foreign.setdefault(id(p), p)
        found = self._foreign[id(step)] = list(foreign.values())
        return found

    def sharing_optimizers(self, step: _Owner) -> list[_Owner]:
        """The other steps with an open window that step one of ``step``'s optimizers."""
        mine = {id(opt) for opt in step.params.optimizers}
        return [o for o in self._others_open(step) if any(id(opt) in mine for opt in o.params.optimizers)]

    def in_open_windows(self, step: _Owner) -> set[int]:
        """The ids of parameters ``step`` shares with other steps whose windows are open."""
        return {id(p) for other in self._others_open(step) for p in other.known_params()}

    def _others_open(self, step: _Owner) -> list[_Owner]:
        """The live steps other than ``step`` whose windows are open."""
        others = (ref() for key, ref in list(self._open.items()) if key != id(step))
        return [other for other in others if other is not None]


OWNERSHIP = Ownership()
"""The one registry of the process (steps are made in one process and never pickled)."""

"""The parameters one ``@accumulate`` step trains: its optimizers', read anew when a param group changes.

The step needs them in two orders: the optimizers' (their checkpointed gradients, the stray and ownership
checks) and the gradient norm's (``model.parameters()``'s where ``model=`` was given, as
``clip_grad_norm_(model.parameters())`` sums them, bit for bit). Both lists are cached; the cache key is the
identity and length of every param group's list, so ``optimizer.add_param_group`` or a list edited in place
is seen at the next read (a few list operations per window, none per micro-step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speedups._helpers.step_context import params_of
from speedups.errors import SpeedupsError

__all__ = ["StepParameters"]

_Shape = list[tuple[int, int]]


class StepParameters:
    """The optimizers' distinct parameters, in their order and in the gradient norm's, cached.

    Args:
        optimizers: the step's optimizers.
        model: the model given as ``model=`` (its ``parameters()`` order is the norm's), or None.
        on_change: called as ``on_change(previous_ids, params)`` whenever the lists are read anew after a
            change (not on the first read): the step warns about parameters that joined mid-window there.
    """

    def __init__(
        self,
        optimizers: tuple[torch.optim.Optimizer, ...],
        model: torch.nn.Module | None,
        on_change: Callable[[set[int], list[torch.Tensor]], None],
    ) -> None:
        self.optimizers = optimizers
        self.model = model
        self._on_change = on_change
        self._shape: _Shape = []
        self._params: list[torch.Tensor] = []
        self._order: list[torch.Tensor] = []
        self._ids: set[int] = set()
        self.version = 0
        """Bumped whenever the lists change (what other steps computed from them is stale then)."""

    def _read(self) -> None:
        shape = [(id(g["params"]), len(g["params"])) for opt in self.optimizers for g in opt.param_groups]
        if shape == self._shape:
            return
        params = params_of(self.optimizers)
        if len(params) != sum(count for _, count in shape):
            raise SpeedupsError(
                "accumulate: a parameter is now listed twice among the step's optimizers (a param "
                "group edited in place with a parameter it or another of the step's optimizers already "
                "holds?), so one update would step it twice. Add each parameter once: `new = [p for p in "
                "backbone.parameters() if all(p is not q for q in group['params'])]`."
            )
        order = params
        ids = {id(p) for p in params}
        if self.model is not None:
            first = [p for p in self.model.parameters() if id(p) in ids]
            placed = {id(p) for p in first}
            order = first + [p for p in params if id(p) not in placed]
        previous, had = self._ids, bool(self._shape)
        self._shape, self._params, self._order, self._ids = shape, params, order, ids
        self.version += 1
        if had:
            self._on_change(previous, params)

    def all(self) -> list[torch.Tensor]:
        """The optimizers' parameters, in optimizer then param-group order (checked for a change).

        Raises:
            SpeedupsError: a parameter now sits in two param groups.
        """
        self._read()
        return self._params

    def norm_order(self) -> list[torch.Tensor]:
        """The parameters in the order the gradient norm sums them (checked for a change)."""
        self._read()
        return self._order

    def ids(self) -> set[int]:
        """The ids of the optimizers' parameters (checked for a change)."""
        self._read()
        return self._ids

    def known(self) -> list[torch.Tensor]:
        """The parameters as last read, without checking for a change (another step asks)."""
        return self._params

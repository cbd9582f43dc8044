"""The update of one ``@accumulate`` step: what its boundary does with a window's gradients.

Unscale once (an fp16 GradScaler), normalise to the window's exact mean, clip (by norm or by value), run the
``before_update`` hooks, step every optimizer or none, then the schedulers; the ``on_update`` hooks run once
the window is closed (see :func:`~speedups._helpers.step_context.apply_update`, which ``mixed_precision``
alone runs too). The update also owns the step's GradScaler: ``mixed_precision("fp16")`` hands it over on
the step's first call; a state loaded before that waits for it, and a restored window flushed before it
arrives is unscaled by a stand-in built from the saved state, whose state then passes to the real one.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from speedups._helpers.step_context import apply_update
from speedups._helpers.validate import short
from speedups.accumulation.checks import warn_skipped
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.update_record import UpdateRecord
from speedups.accumulation.window import ITEMS, Window
from speedups.errors import SpeedupsError

__all__ = ["Update"]


class Update:
    """The optimizer update of a step's window, its GradScaler and its per-update hooks.

    Attributes:
        num_updates: optimizer steps really taken. last_step_skipped: whether the last update was skipped.
        last_grad_norm: the total norm before clipping of the last update (a 0-dim tensor), or None.
        probe: the 0-dim tensor whose finiteness the last update checked, or None.
        scaler: the adopted GradScaler, or None. updating: True while the optimizers step (the guard lets
            those steps pass). hooks, before_hooks: the ``on_update`` and ``before_update`` functions.
    """

    def __init__(
        self,
        params: StepParameters,
        schedulers: tuple[Any, ...],
        *,
        max_grad_norm: float | None,
        max_grad_value: float | None,
        skip_nonfinite: bool,
    ) -> None:
        self.params = params
        self.optimizers = params.optimizers
        self.schedulers = schedulers
        self.max_grad_norm = max_grad_norm
        self.max_grad_value = max_grad_value
        self.skip_nonfinite = skip_nonfinite
        self.num_updates = 0
        self.last_step_skipped = False
        self.last_grad_norm: torch.Tensor | None = None
        self.probe: torch.Tensor | None = None
        self.updating = False
        self.scaler: torch.amp.GradScaler | None = None
        self.restored_scaler: dict[str, Any] | None = None  # a loaded scaler state, for the scaler to come
        self.stand_in = False  # the scaler is the step's own, built by a flush before mixed_precision's came
        # hooks by handle id: OrderedDicts, as torch's (a RemovableHandle holds them weakly)
        self.hooks: OrderedDict[int, Callable[[UpdateRecord], Any]] = OrderedDict()
        self.before_hooks: OrderedDict[int, Callable[[list[torch.Tensor]], Any]] = OrderedDict()
        # Nothing to unscale, clip or check: an update is the optimizers' steps alone (no scaler yet).
        self.plain = max_grad_norm is None and max_grad_value is None and not skip_nonfinite

    # ------------------------------------------------------------------------------------ the update
    def apply(self, window: Window, step: int, pending: int, synced: bool) -> UpdateRecord | None:
        """Apply the window of ``pending`` calls ending at micro-step ``step``; return the record the
        ``on_update`` hooks get (None when none is registered or nothing stepped).

        ``synced``: the gradients were averaged over the ranks by their sync (DDP, FSDP2). The caller zeroes
        the gradients and closes the window afterwards, whatever this raises.
        """
        if window.mode is ITEMS and not window.has_items(step):
            self.last_step_skipped = True
            warn_skipped(step, empty=True)
            return None
        factor = window.factor(pending, synced)
        lrs = [g["lr"] for opt in self.optimizers for g in opt.param_groups] if self.hooks else None
        self.updating = True  # the optimizer steps below are this step's own: its guard lets them pass
        try:
            # nothing but the optimizers' steps (a tensor factor, from device item counts, is never read)
            if self.plain and type(factor) is float and factor == 1.0 and not self.before_hooks:
                for optimizer in self.optimizers:
                    optimizer.step()
                stepped, self.last_grad_norm, self.probe = True, None, None
            else:
                stepped, self.last_grad_norm, self.probe = apply_update(
                    self.optimizers,
                    self.scaler,
                    self.max_grad_norm,
                    factor,
                    skip_nonfinite=self.skip_nonfinite,
                    params=self.params.norm_order,
                    probe=window.probe(),
                    max_grad_value=self.max_grad_value,
                    before_step=self._before_step if self.before_hooks else None,
                )
        finally:
            self.updating = False
        self.last_step_skipped = not stepped
        if not stepped:
            if self.scaler is None:
                warn_skipped(step, empty=False, clipping=self.max_grad_norm is not None)
            return None
        self.num_updates += 1
        for scheduler in self.schedulers:
            scheduler.step()
        if lrs is None:
            return None
        return UpdateRecord(
            step, self.num_updates, pending, window.items(), self.last_grad_norm, lrs, window.log,
            window.mode is ITEMS,
        )  # fmt: skip

    def zero_grad(self) -> None:
        """Drop every gradient of the step's optimizers (to None)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def after(self, record: UpdateRecord | None) -> None:
        """Run the ``on_update`` hooks, in registration order, on the record of an update really taken."""
        if record is not None:
            for hook in list(self.hooks.values()):
                hook(record)

    def _before_step(self) -> None:
        params = [p for p in self.params.norm_order() if p.grad is not None]
        for hook in list(self.before_hooks.values()):
            hook(params)

    # ------------------------------------------------------------------------------------- hooks
    def on_update(self, fn: Callable[[UpdateRecord], Any]) -> RemovableHandle:
        """Call ``fn(record)`` after every optimizer step really taken; return a removable handle.

        Raises:
            TypeError: ``fn`` is not a function of one argument.
        """
        if not callable(fn) or not _takes_one_argument(fn):
            raise TypeError(
                f"train_step.on_update({short(fn)}): expected a function of one argument, the "
                f"UpdateRecord. Write train_step.on_update(lambda record: ema.update_parameters(model))."
            )
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = fn
        return handle

    def before_update(self, fn: Callable[[list[torch.Tensor]], Any]) -> RemovableHandle:
        """Call ``fn(params)`` just before every optimizer step really taken; return a removable handle.

        Raises:
            TypeError: ``fn`` is not a function of one argument.
        """
        if not callable(fn) or not _takes_one_argument(fn):
            raise TypeError(
                f"train_step.before_update({short(fn)}): expected a function of one argument, the list of "
                f"parameters with gradients. Write train_step.before_update(lambda params: "
                f"torch.nn.utils.clip_grad_value_(params, 0.5))."
            )
        handle = RemovableHandle(self.before_hooks)
        self.before_hooks[handle.id] = fn
        return handle

    # ------------------------------------------------------------------------------------- scaler
    def adopt_scaler(self, scaler: torch.amp.GradScaler, pending: int) -> torch.amp.GradScaler:
        """Take ``scaler`` from ``mixed_precision`` (or keep the one already adopted); return the scaler used.

        Raises:
            SpeedupsError: it arrives in the middle of a window (``pending`` unscaled calls accumulated).
        """
        if self.scaler is None or self.stand_in:
            restored = self._handed_over()  # a state loaded before the scaler existed, if any
            if restored is not None:
                scaler.load_state_dict(restored)
            elif pending:
                raise SpeedupsError(
                    f"accumulate: a GradScaler arrived in the middle of an accumulation window "
                    f"({pending} unscaled micro-steps already accumulated). Enter mixed_precision in "
                    f"every call of the step, from the first one, e.g. stack @mixed_precision('fp16') under "
                    f"@accumulate."
                )
            self.scaler, self.stand_in = scaler, False
            self.plain = False
        return self.scaler

    def _handed_over(self) -> dict[str, Any] | None:
        """The scaler state a newly arrived GradScaler must take: the stand-in's, or one loaded earlier."""
        if self.stand_in:
            assert self.scaler is not None
            return dict(self.scaler.state_dict())
        state, self.restored_scaler = self.restored_scaler, None
        return state

    def stand_in_scaler(self) -> None:
        """Before a flush with a restored scaler state and no scaler yet: build one from that state."""
        if self.scaler is not None or self.restored_scaler is None:
            return
        device = next((p.device for p in self.params.all()), torch.device("cpu"))
        scaler = torch.amp.GradScaler(device.type)
        scaler.load_state_dict(self.restored_scaler)
        scaler.scale(torch.zeros((), device=device))  # builds its scale tensor from the loaded state (lazy)
        self.scaler, self.stand_in, self.restored_scaler = scaler, True, None
        self.plain = False

    def scaler_state(self) -> dict[str, Any] | None:
        """The GradScaler's state for a checkpoint (a loaded one still waiting for its scaler), or None."""
        return self.restored_scaler if self.scaler is None else self.scaler.state_dict()

    def restore(self, num_updates: int, state: dict[str, Any] | None) -> None:
        """Restore a checkpoint's update count and scaler state (applied now, or when ``mixed_precision``
        hands the scaler over)."""
        self.num_updates = num_updates
        if state is None:
            return
        if self.scaler is not None:
            self.scaler.load_state_dict(state)
        else:  # the scaler arrives with the first fp16 call, which applies this (adopt_scaler)
            self.restored_scaler = dict(state)


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    """Whether ``fn(record)`` binds (True when its signature cannot be read, as for some builtins)."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True

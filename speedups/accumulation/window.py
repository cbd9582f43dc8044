"""The open accumulation window of one ``@accumulate`` step: how its calls are weighed and what it counted.

A window's calls are weighed alike (a bare mean loss: each backward gets ``1/every``) or by their item
counts (``(loss, num_items)``: each backward gets ``num_items / reference``, the reference being the
window's first count on one process, 1 on several ranks, so the boundary divides by the window's total
exactly; "Fixing Gradient Accumulation", Hugging Face, 2024). The first call fixes the form. The window
also keeps what the boundary needs besides the gradients: the item totals (on the host for Python numbers,
on the device for tensors, never synced while counting), the losses that ``skip_nonfinite`` checks in one
go, and the per-call log from which an ``UpdateRecord`` computes the window's mean loss.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch

from speedups.accumulation.checks import check_result
from speedups.accumulation.grad_sync import GradSync, SyncKind, count_dtype
from speedups.accumulation.output import as_loss_and_items
from speedups.accumulation.parameters import StepParameters
from speedups.accumulation.zero_items import GradMask, Keep, keep_of
from speedups.errors import SpeedupsError

__all__ = ["ITEMS", "MEAN", "Mode", "Window"]


class Mode(enum.Enum):
    """How the calls of a window are weighed, fixed by the first call: alike, or by their item count."""

    MEAN = "mean"
    ITEMS = "items"


MEAN, ITEMS = Mode.MEAN, Mode.ITEMS  # module globals: read on every call, faster than Mode.MEAN


class Window:
    """The weighing and the counts of a step's open window (the calls themselves are the step's to count).

    Attributes:
        every: calls per window. inv_every: ``1 / every``, a bare mean loss's weight.
        mode: ``MEAN`` or ``ITEMS`` once the first call fixed it, else None.
        total_host, total_device: the window's item count given as Python numbers, and as tensors (None
            while none was). ref_n: the weight reference of the item counts (see ``GradSync.reference``).
        losses: the detached losses ``skip_nonfinite`` checks at the boundary (one process only).
        log: per call ``(loss or loss * items, items)``, kept while an ``on_update`` hook is registered.
    """

    def __init__(self, every: int, sync: GradSync, params: StepParameters, *, check_losses: bool) -> None:
        self.every = every
        self.inv_every = 1.0 / every
        self.sync = sync
        self.params = params
        self.mask = GradMask()  # drops the gradients of zero-item micro-steps (see .zero_items)
        self.check_losses = check_losses
        self.mode: Mode | None = None
        self.total_host = 0.0
        self.total_device: torch.Tensor | None = None
        self.ref_n: Any = 1.0
        self.losses: list[torch.Tensor] = []
        self.log: list[tuple[torch.Tensor, Any]] = []

    # ---------------------------------------------------------------------------------------- a call
    def parse(self, out: Any) -> tuple[torch.Tensor, Any]:
        """Check a call's result; return ``(loss, num_items)`` (None for a bare loss). Fixes the mode.

        Raises:
            TypeError, ValueError: see :func:`~speedups.accumulation.checks.check_result`.
            SpeedupsError: the call switched between a bare loss and ``(loss, num_items)``.
        """
        if (  # the common case, in as few checks as possible; grad_fn implies a floating dtype
            self.mode is MEAN
            and type(out) is torch.Tensor
            and out.dim() == 0
            and out.grad_fn is not None
            and not out.is_complex()
        ):
            return out, None
        loss, n = check_result(as_loss_and_items(out))
        mode = MEAN if n is None else ITEMS
        if self.mode is None:
            self.mode = mode
        elif mode != self.mode:
            raise SpeedupsError(
                f"accumulate: this step returned {'a bare loss' if n is None else '(loss, num_items)'} after "
                f"returning {'a bare loss' if self.mode == MEAN else '(loss, num_items)'} before. "
                f"Return the same form on every call."
            )
        return loss, n

    def weigh_items(self, loss: torch.Tensor, n: Any, *, first: bool) -> tuple[torch.Tensor, Keep]:
        """The tensor to backward for a micro-step of ``n`` items (counted here), and the gradients it keeps.

        ``first``: the window's first micro-step, whose count is the weight reference.
        """
        if first:
            self.ref_n = self.sync.reference(n)
        self._add_items(n)
        return self.sync.weigh(loss, n, self.ref_n), keep_of(n)

    def _add_items(self, n: Any) -> None:
        if isinstance(n, torch.Tensor):
            n = n.detach().reshape(()).to(count_dtype(n.device))
            # unread until the boundary (no sync per call): a negative or NaN/inf count makes the window's
            # total NaN, on every rank once summed, and has_items raises there
            n = torch.where((n >= 0) & n.isfinite(), n, torch.nan)
            self.total_device = n if self.total_device is None else self.total_device + n
        else:
            self.total_host += float(n)

    def backward(self, target: torch.Tensor, keep: Keep, weight: float, scaler: Any) -> None:
        """Backward of ``target * weight``, scaled for the GradScaler ``scaler`` if any; ``keep``: which
        gradients count (see ``keep_of``).

        Without a scaler or a mask, ``weight`` goes in as backward's output gradient, a new tensor of
        ``target``'s shape, dtype and device: what ``(target * weight).backward()`` sends into the graph, bit
        for bit, with one op and one autograd node fewer per micro-step. It is made on every call, as
        backward's own ``ones_like`` is: autograd may hand it on as a parameter's ``.grad`` (a loss that is a
        view of a parameter) or to a backward that edits its input.
        """
        if scaler is None and keep is None:  # the common case
            target.backward(None if weight == 1.0 else torch.full_like(target, weight))
            return
        if weight != 1.0:
            target = target * weight
        if scaler is not None:
            target = scaler.scale(target)
        if keep is None:  # every gradient counts: the plain backward
            target.backward()
        else:
            single = self.sync.kind is SyncKind.SINGLE
            self.mask.backward(target, keep, self.params.all(), single=single)

    def keep_loss(self, detached: torch.Tensor, keep: Keep) -> None:
        """Keep a call's loss for the boundary's NaN/inf check (``skip_nonfinite`` on one process)."""
        if keep is not False:
            self.losses.append(detached if keep is None else torch.where(keep, detached, 0.0))

    def log_call(self, loss: torch.Tensor, n: Any, keep: Keep) -> None:
        """Keep what the window's mean loss needs of this call: its loss (times its items), its items."""
        if n is None:
            self.log.append((loss, None))
        elif keep is False:
            self.log.append((torch.zeros_like(loss), n))
        else:
            n = n.detach() if isinstance(n, torch.Tensor) else n
            part = loss * n
            self.log.append((part if keep is None else torch.where(keep, part, 0.0), n))

    # -------------------------------------------------------------------------------- the boundary
    def local_count(self, device: torch.device) -> torch.Tensor:
        """This rank's item count of the window as a 0-dim tensor on ``device``."""
        if self.total_device is None:
            return torch.full((), self.total_host, dtype=count_dtype(device), device=device)
        return self.total_device + self.total_host

    def set_count(self, count: torch.Tensor) -> None:
        """The window's count is ``count`` (summed over the ranks): the boundary divides by it."""
        self.total_device, self.total_host = count, 0.0

    def factor(self, pending: int, synced: bool) -> float | torch.Tensor:
        """What the synchronised gradients of ``pending`` calls are multiplied by to be the exact mean."""
        averaged = self.sync.world if synced else 1  # DDP/FSDP2 divide by the world size when they sync
        if self.mode == ITEMS:
            # A window of zero items (all padding) has nothing to learn from: its gradients are zeroed, never
            # divided by zero (an exact 0 count on the host also skips the optimizer step, see has_items).
            if self.total_device is None:
                return averaged * self.ref_n / self.total_host if self.total_host else 0.0
            total = self.total_device + self.total_host
            return torch.where(total > 0, averaged * self.ref_n / total, torch.zeros_like(total)).float()
        return averaged * self.every / (self.sync.world * pending)

    def has_items(self, step: int) -> bool:
        """Whether the window (all ranks) holds items; a host-device sync only for device-tensor counts.

        Raises:
            ValueError: a count given as a tensor (unread until now) was negative or not finite, on this
                rank or, summed into the window's count, on another (``step``: the micro-step that ends the
                window, for the message).
        """
        if self.total_device is None:
            return bool(self.total_host)
        total = (self.total_device + self.total_host).item()  # host-device sync, once per step
        if not math.isfinite(total):
            raise ValueError(
                f"accumulate: a num_items returned in the window ending at micro-step {step} was negative "
                f"or not finite (a count on the device is checked here, at the optimizer step, so that no "
                f"call waits for it); the window was dropped and nothing was stepped. Return a count >= 0: "
                f"(loss, len(y)) or (loss, mask.sum())."
            )
        return total > 0

    def probe(self) -> torch.Tensor | None:
        """The summed losses whose finiteness decides a ``skip_nonfinite`` update, or None."""
        return torch.stack(self.losses).sum() if self.check_losses and self.losses else None

    def items(self) -> Any:
        """The window's item count for its ``UpdateRecord`` (None for mean losses)."""
        if self.mode is not ITEMS:
            return None
        if self.total_device is None:
            return self.total_host
        return self.total_device if not self.total_host else self.total_device + self.total_host

    def reset(self) -> None:
        """Empty the window (its update was applied or dropped). The lists are replaced, not cleared: an
        ``UpdateRecord`` keeps the last window's log."""
        if self.mode is ITEMS:
            self.total_host = 0.0
            self.total_device = None
            self.ref_n = 1.0
        if self.losses:
            self.losses = []
        if self.log:
            self.log = []

    # --------------------------------------------------------------------------------------- state
    def counts(self) -> tuple[float, torch.Tensor | None, Any]:
        """The open window's item counts and weight reference (the micro-batcher undoes a failed try)."""
        return self.total_host, self.total_device, self.ref_n

    def restore_counts(self, snapshot: tuple[float, torch.Tensor | None, Any]) -> None:
        """Put back what :meth:`counts` returned."""
        self.total_host, self.total_device, self.ref_n = snapshot

    def state_dict(self) -> dict[str, Any]:
        """The window's part of a step's checkpoint state (tensors copied)."""
        return {
            "mode": None if self.mode is None else self.mode.value,
            "total_host": self.total_host,
            "total_device": None if self.total_device is None else self.total_device.clone(),
            "losses": [loss.clone() for loss in self.losses],
            "ref_n": self.ref_n.clone() if isinstance(self.ref_n, torch.Tensor) else self.ref_n,
            "log": [(x.clone(), n.clone() if isinstance(n, torch.Tensor) else n) for x, n in self.log],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked by the step before)."""
        self.mode = None if state["mode"] is None else Mode(state["mode"])
        self.total_host = float(state["total_host"])
        self.total_device = state["total_device"]
        self.losses = list(state.get("losses", []))
        self.ref_n = state.get("ref_n", 1.0)
        self.log = list(state.get("log", []))


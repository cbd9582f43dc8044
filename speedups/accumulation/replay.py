"""An FSDP2 window's pending calls, kept so that a checkpoint taken mid-window can make them again.

Between a window's boundaries FSDP2 keeps the unreduced gradients of its calls in buffers of its own, which
no public API reads or restores. What made them can be kept instead: each pending call's inputs (references
to what the call was given, no copy), the RNG states it started from, and the model's buffers as the window
found them. A checkpoint saves those; after loading it, the step's next call first runs the pending calls
again through its own call path (forward and backward, gradient sync as they had it, outputs dropped), from
those inputs, RNG states and buffers, then puts back the RNG states loaded with them. The same computation
on the same weights: FSDP2's buffers end as the saved run's did, bit for bit, at the cost of recomputing at
most ``every - 1`` micro-steps once per resume.

Inputs are saved on the CPU with the device each tensor was on, in a form ``torch.load(weights_only=True)``
reads: tensors, numbers, strings, bytes, None, and lists, tuples and dicts of those. The user's function runs
again for the pending calls, so what it does besides computing the loss (a print, a tracker updated inside
it) happens again; inputs changed in place after their call are saved as they are at the save.
"""

from __future__ import annotations

from typing import Any

import torch

from speedups._helpers.rng import get_rng_states
from speedups.errors import SpeedupsError

__all__ = ["PendingCalls", "decode_inputs", "encode_inputs"]


class PendingCalls:
    """The pending calls of an FSDP2 step's open window (see the module's docstring).

    Attributes:
        calls: per pending call, ``(args, kwargs, rng, synced)``: its inputs, the global RNG states it
            started from (:func:`~speedups._helpers.rng.get_rng_states`), and whether its backward ran with
            gradient sync on (the last call of an ``epoch()`` pass).
        buffers: the model's buffers as the window's first call found them (copies), by name.
        due: calls loaded from a checkpoint, to run again before the step's next call (or None).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[Any, Any, dict[str, Any], bool]] = []
        self.buffers: dict[str, torch.Tensor] = {}
        self.due: dict[str, Any] | None = None

    def before(self, first: bool) -> dict[str, Any]:
        """At a call's start: the RNG states it starts from; on a window's first call, keep the buffers."""
        if first:
            self.buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        return get_rng_states()

    def after(self, rng: dict[str, Any], args: Any, kwargs: Any, synced: bool, pending: int) -> None:
        """The call ran and was counted: keep it while its window stays open (``pending`` calls)."""
        if pending:
            self.calls.append((args, kwargs, rng, synced))
        else:
            self.clear()

    def clear(self) -> None:
        """The window closed (applied or dropped): also a loaded window not yet made again."""
        if self.calls or self.buffers:
            self.calls, self.buffers = [], {}
        self.due = None

    # ------------------------------------------------------------------------------------ checkpoints
    def state(self, pending: int, said: str) -> dict[str, Any]:
        """The pending calls in a checkpoint's form (inputs and buffers on the CPU).

        Raises:
            SpeedupsError: an input of a pending call is not a kind a checkpoint holds (nothing is saved).
        """
        if self.due is not None:  # loaded, not yet run again: save them as loaded
            return self.due
        from speedups.checkpoint.file_format import rng_to_file

        if len(self.calls) != pending:
            raise SpeedupsError(
                f"{said}: {pending} micro-steps are pending on an FSDP2 model, but {len(self.calls)} of "
                f"them were seen by the step (a window restored without them?). Save at a boundary: "
                f"`if train_step.pending == 0: save_checkpoint(...)`."
            )
        calls = []
        for i, (args, kwargs, rng, synced) in enumerate(self.calls):
            where = f"{said}: micro-step {i + 1} of the open window"
            calls.append({
                "args": encode_inputs(args, where), "kwargs": encode_inputs(kwargs, where),
                "rng": rng_to_file(rng), "synced": synced,
            })  # fmt: skip
        buffers = {name: b.cpu() for name, b in self.buffers.items()}
        return {"calls": calls, "buffers": buffers}

    def check(self, state: Any, pending: int, call: str) -> None:
        """Raise ``ValueError`` unless ``state`` is what :meth:`state` gives for ``pending`` calls here."""
        if not isinstance(state, dict) or not isinstance(state.get("calls"), list):
            raise ValueError(f"{call}: state['replay'] is not the pending calls a step saved.")
        if len(state["calls"]) != pending:
            raise ValueError(
                f"{call}: state['replay'] holds {len(state['calls'])} calls, for {pending} pending ones."
            )
        names = dict(self.model.named_buffers())
        saved = state.get("buffers")
        if not isinstance(saved, dict) or set(saved) != set(names):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"{call}: the window was saved with the model buffers {got}, this model has "
                f"{sorted(names)}. Resume with the same model."
            )
        for name, value in saved.items():
            if not isinstance(value, torch.Tensor) or value.shape != names[name].shape:
                raise ValueError(f"{call}: the saved buffer {name!r} does not fit this model's.")

    def load(self, state: dict[str, Any]) -> None:
        """Keep the saved calls (checked by :meth:`check`) to run before the next call."""
        self.clear()
        self.due = state if state["calls"] else None

    def take(self) -> tuple[list[tuple[Any, Any, dict[str, Any], bool]], dict[str, torch.Tensor]]:
        """The due calls with their inputs on their devices and their RNG states, and the window's buffers;
        nothing is due afterwards."""
        from speedups.checkpoint.file_format import rng_from_file

        due, self.due = self.due, None
        assert due is not None
        calls = [
            (decode_inputs(c["args"]), decode_inputs(c["kwargs"]), rng_from_file(c["rng"]), bool(c["synced"]))
            for c in due["calls"]
        ]
        return calls, dict(due["buffers"])

    def put_buffers(self, values: dict[str, torch.Tensor]) -> None:
        """Copy ``values`` (the window's buffers, by name) into the model's buffers."""
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(values[name])


_PLAIN = (int, float, bool, str, bytes, type(None))


def encode_inputs(value: Any, where: str) -> Any:
    """``value`` in a form ``torch.load(weights_only=True)`` reads back as it was: tensors on the CPU with
    their device, containers tagged (that loading turns tuples into lists).

    Raises:
        SpeedupsError: ``value`` holds something else (named in the message).
    """
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor:
            raise _unsaveable(where, value)
        data = value.detach().to("cpu", copy=True)  # compact: a view saves its own elements only
        return {"tensor": data, "device": str(value.device), "requires_grad": value.requires_grad}
    if type(value) in _PLAIN:
        return {"plain": value}
    if type(value) in (list, tuple):
        return {type(value).__name__: [encode_inputs(v, where) for v in value]}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode_inputs(v, where) for k, v in value.items()}}
    raise _unsaveable(where, value)


def decode_inputs(value: dict[str, Any]) -> Any:
    """Undo :func:`encode_inputs` (tensors back on their devices, or the CPU where that device is absent)."""
    if "tensor" in value:
        device = torch.device(value["device"])
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
        tensor = value["tensor"].to(device)
        return tensor.requires_grad_() if value["requires_grad"] else tensor
    if "plain" in value:
        return value["plain"]
    if "list" in value:
        return [decode_inputs(v) for v in value["list"]]
    if "tuple" in value:
        return tuple(decode_inputs(v) for v in value["tuple"])
    return {k: decode_inputs(v) for k, v in value["dict"].items()}


def _unsaveable(where: str, value: Any) -> SpeedupsError:
    return SpeedupsError(
        f"{where} (pending on an FSDP2 model) was given a {type(value).__name__}; a checkpoint taken "
        f"mid-window under FSDP2 saves the pending calls' inputs to make them again on resume, and holds "
        f"tensors, numbers, strings, None, and lists, tuples and dicts (str keys) of those. Pass the batch "
        f"in such a form, or save at a boundary: `if train_step.pending == 0: save_checkpoint(...)`."
    )

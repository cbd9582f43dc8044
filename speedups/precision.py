"""Tip 7: 16-bit mixed precision (autocast and loss scaling) that composes with ``@accumulate``.

``with mixed_precision():`` runs the forward pass under ``torch.autocast`` in the 16-bit dtype this device is
fast at, and stays in fp32 (with one warning) where 16-bit would be slower. fp16 owns a
``torch.amp.GradScaler``; inside an ``@accumulate`` step the step takes that scaler over, scales each
backward and unscales once per optimizer step, before clipping.
"""

from __future__ import annotations

import contextvars
import inspect
import warnings
import weakref
from typing import Any, TypeVar

import torch
import wrapt
from torch.optim.optimizer import register_optimizer_step_post_hook

from speedups._helpers import env, validate
from speedups._helpers.hardware import cpu_has_native_bf16, gpu_has_native_bf16
from speedups._helpers.step_context import apply_update, check_clipping, current_step, params_of
from speedups.device import default_device
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["mixed_precision"]

F = TypeVar("F")

_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
_OFF = ("fp32", "float32")  # the same as enabled=False: full precision, a true no-op
_ALLOWED = "'auto', 'bf16', 'fp16', torch.bfloat16 or torch.float16 ('fp32': off)"

# The open entries of this thread / task, innermost last: (the mixed_precision object, its autocast, token).
# A ContextVar rather than state on the object, so one object can nest and serve several threads.
_ENTRIES: contextvars.ContextVar[tuple[list[Any], ...]] = contextvars.ContextVar(
    "speedups_mixed_precision_entries", default=()
)


_step_hook: list[Any] = []  # the process-wide optimizer step post-hook, registered once (see below)


def _drop_stale_weight_casts(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer step taken while one of our autocast contexts is open: drop autocast's cache.

    ``torch.autocast`` caches the low-precision copy of each weight it casts and clears the cache only when
    the outermost autocast exits; an optimizer step inside the block would leave later forwards on copies
    of the old weights. One ContextVar read per optimizer step (none per micro-step); a no-op outside ours.
    """
    if _ENTRIES.get():
        torch.clear_autocast_cache()


def _watch_optimizer_steps() -> None:
    if not _step_hook:  # once per process: every optimizer, hand-written steps too
        _step_hook.append(register_optimizer_step_post_hook(_drop_stale_weight_casts))


def _known_device_types() -> list[str]:
    return ["cpu", "cuda", "mps", "xpu", "hpu", "mtia", "xla", "privateuseone"]


class mixed_precision:  # lowercase like torch.autocast: used as a function/context manager
    """Run the enclosed forward pass in 16-bit autocast, with loss scaling for fp16.

    A context manager and a decorator; each entry makes its own ``torch.autocast``, so one object nests and
    serves several threads. It speeds up devices with fast 16-bit matmuls (GPU tensor cores, CPUs with
    AVX-512 BF16 or AMX) and halves activation memory; elsewhere ``"auto"`` stays in fp32 with one
    :class:`~speedups.SpeedupsWarning` (rank 0 only). ``"auto"`` picks bf16 where supported, else fp16 with
    loss scaling on older GPUs. An explicit dtype torch would silently ignore raises instead.

    fp16 owns a ``torch.amp.GradScaler`` (:attr:`scaler`). Inside an ``@accumulate`` step (stacked under the
    decorator or as ``with`` in its body) the step takes the scaler over: it scales each backward, unscales
    once per optimizer step before clipping, and skips the optimizer and scheduler steps on overflow. One
    object may serve several steps (a GAN's generator and discriminator): the first step uses
    :attr:`scaler`, every other step a GradScaler of its own (saved with that step's ``state_dict``), as
    PyTorch's AMP recipe keeps one per optimizer, so one step's overflow never rescales another's window.
    Outside a step, use :meth:`backward` and :meth:`step`. bf16 needs no scaler.

    A whole loop may run inside one ``with``: after every optimizer step taken while the context is open
    (ours, ``@accumulate``'s or a hand-written ``optimizer.step()``), autocast's cache of low-precision weight
    copies is cleared, so the next forward casts the updated weights (torch alone keeps the stale copies
    until the outermost autocast exits). A weight changed in place without an optimizer inside the block
    needs ``torch.clear_autocast_cache()``.

    Sync points: none in the context; fp16 :meth:`step` makes ``GradScaler.step``'s one inf/NaN check.
    From: Micikevicius et al., "Mixed Precision Training" (2018); PyTorch's AMP documentation.

    Args:
        dtype: ``"auto"``, ``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``/``"half"``,
            ``torch.bfloat16`` or ``torch.float16``; ``"fp32"``/``"float32"``: off (as ``enabled=False``).
        device_type: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``, ...); None: the type of
            this process's default device.
        init_scale: the GradScaler's first loss scale (fp16 only); a lower one skips fewer first steps.
        enabled: False makes it a true no-op (:meth:`backward`/:meth:`step` become the plain calls).

    Raises:
        TypeError: ``dtype`` or ``device_type`` of the wrong type; decorating a class.
        ValueError: an unknown dtype (``"fp8"``), a dtype that is not 16-bit floating point
            (``torch.float32``, ``torch.int8``), an unknown ``device_type``, or a dtype torch cannot autocast
            to on that device type.
        SpeedupsError: ``device_type`` names a device this machine does not have.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> with mixed_precision("bf16", device_type="cpu"):
        ...     out = model(torch.ones(3, 4))
        >>> out.dtype, model.weight.dtype
        (torch.bfloat16, torch.float32)
    """

    def __init__(
        self,
        dtype: str | torch.dtype = "auto",
        *,
        device_type: str | None = None,
        init_scale: float = 2.0**16,
        enabled: bool = True,
    ) -> None:
        with validate.arguments(f"mixed_precision({dtype!r})"):
            validate.flag(enabled, "enabled")
            validate.real(init_scale, "init_scale", positive=True, example="2.0**16")
        if isinstance(dtype, str) and dtype.lower() in _OFF:
            enabled = False  # full precision asked for by name: the documented no-op
        self.device_type = _check_device_type(device_type, dtype, enabled=enabled)
        self.dtype: torch.dtype | None = None
        """The autocast dtype, or None when the object is a no-op (fp32)."""
        self.scaler: torch.amp.GradScaler | None = None
        """The fp16 loss scaler (None for bf16 and fp32)."""
        self.last_step_skipped = False
        """Whether the last :meth:`step` skipped the optimizer step (fp16 overflow). No new sync to read."""
        self._scaled_backwards = 0  # fp16: amp.backward calls since the last amp.step
        self.found_inf: torch.Tensor | None = None
        """After :meth:`step` with fp16: a 0-dim bool device tensor, True if the gradients held inf/NaN."""
        wanted = _check_dtype(dtype, self.device_type)
        if not enabled:
            return
        if wanted is None:
            wanted, why = _auto_dtype(self.device_type)
            if wanted is None:
                if env.rank() == 0:
                    warnings.warn(
                        f"mixed_precision('auto'): {why}; staying in fp32 (autocast off). Pass "
                        f"mixed_precision('bf16') to force it anyway, or enabled=False to silence this. For "
                        f"fp32 speed, speedups.fast_kernels(model) turns on TF32 for matmuls and "
                        f"convolutions on an NVIDIA GPU (Ampere on) and channels_last convolutions anywhere.",
                        SpeedupsWarning,
                        stacklevel=2,
                    )
                return
        else:
            _check_supported(dtype, wanted, self.device_type)
        self.dtype = wanted
        _watch_optimizer_steps()
        if wanted == torch.float16:
            self.scaler = torch.amp.GradScaler(self.device_type, init_scale=float(init_scale))
        self._init_scale = float(init_scale)
        self._owner: weakref.ref[Any] | None = None  # the step that uses self.scaler
        self._per_step: weakref.WeakKeyDictionary[Any, torch.amp.GradScaler] = weakref.WeakKeyDictionary()

    @property
    def enabled(self) -> bool:
        """Whether autocast is on (False for enabled=False and for an "auto" that stayed in fp32)."""
        return self.dtype is not None

    def __repr__(self) -> str:
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32 (off)"}[self.dtype]
        return f"mixed_precision({name}, device_type={self.device_type!r})"

    def _scaler_for(self, step: Any) -> torch.amp.GradScaler:
        """The GradScaler of ``step``: :attr:`scaler` for the first step entered, a new one for each other.

        One loss scale per step, as PyTorch's AMP recipe keeps one GradScaler per optimizer: an overflow in
        one step's window (a GAN's discriminator) then never rescales another step's open window.
        """
        assert self.scaler is not None
        owner = None if self._owner is None else self._owner()
        if owner is None or owner is step:
            self._owner = weakref.ref(step)
            return self.scaler
        if step not in self._per_step:
            self._per_step[step] = torch.amp.GradScaler(self.device_type, init_scale=self._init_scale)
        return self._per_step[step]

    # -------------------------------------------------------------------------------- context manager
    def __enter__(self) -> mixed_precision:
        if self.dtype is None:
            return self
        if self.scaler is not None:
            step = current_step.get()
            if step is not None:
                step.adopt_scaler(self._scaler_for(step))
        autocast = torch.autocast(self.device_type, dtype=self.dtype)
        autocast.__enter__()
        entry: list[Any] = [self, autocast, None]
        entry[2] = _ENTRIES.set((*_ENTRIES.get(), entry))  # the token that closes this entry
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dtype is None:
            return
        entries = _ENTRIES.get()
        if not entries or entries[-1][0] is not self:
            raise SpeedupsError(
                "mixed_precision.__exit__: this object is not the innermost open mixed_precision context in "
                "this thread. Close contexts in the reverse order of opening (use `with` blocks)."
            )
        _, autocast, token = entries[-1]
        try:
            autocast.__exit__(*exc)
        finally:
            _ENTRIES.reset(token)

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so that each call runs inside its own entry of this context.

        Raises:
            TypeError: ``fn`` is a class (decorate its method instead), a generator function, or not callable.
        """
        if inspect.isclass(fn):
            raise TypeError(
                f"mixed_precision(...)({fn.__name__}): cannot decorate a class. Decorate its method "
                f"instead, e.g. `@mixed_precision('bf16')` above `def forward(self, x):`."
            )
        if not callable(fn):
            raise TypeError(f"mixed_precision(...)({fn!r}): expected a function or method to decorate.")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"mixed_precision(...)({getattr(fn, '__name__', fn)}): a generator function runs its body "
                f"after the call has returned, outside autocast. Use `with mixed_precision(...):` inside it."
            )
        if self.dtype is None:
            return fn

        @wrapt.decorator
        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            with self:
                return wrapped(*args, **kwargs)

        return wrapper(fn)  # type: ignore[return-value]

    # ----------------------------------------------------------------------------------- standalone use
    def backward(self, loss: torch.Tensor) -> None:
        """Run backward on ``loss``, scaled by the GradScaler with fp16 (plain ``loss.backward()`` otherwise).

        Raises:
            SpeedupsError: called inside an ``@accumulate`` step (the step runs backward itself: return the
                loss instead).
        """
        if current_step.get() is not None:
            raise SpeedupsError(
                "mixed_precision.backward(loss): called inside an @accumulate step, which runs backward "
                "itself. Return the loss from the step instead."
            )
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        self._scaled_backwards += 1

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float | None = None,
        max_grad_value: float | None = None,
    ) -> bool:
        """Unscale once (fp16), clip (``max_grad_norm``: the total norm; ``max_grad_value``: each element),
        then step the optimizer or skip it.

        With fp16 the step is skipped when the unscaled gradients hold inf/NaN (one host-device sync reads
        that, for fused optimizers too, whose own skip GradScaler cannot report) and ``GradScaler.update``
        adjusts the scale; :attr:`last_step_skipped` (a bool, no further sync) and :attr:`found_inf` (a
        device tensor) say what happened. With bf16 or fp32 this is
        ``optimizer.step()`` after the optional clip. Gradients are not zeroed: call
        ``optimizer.zero_grad()`` as usual.

        Returns:
            True when the optimizer really stepped: step your LR scheduler only then.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``; a clipping bound is not a number.
            ValueError: a clipping bound is not positive and finite, or both are given.
            SpeedupsError: fp16, and no :meth:`backward` since the last step (``loss.backward()`` was called
                instead, so the gradients are not scaled; nothing is changed).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"mixed_precision.step(optimizer={type(optimizer).__name__}): expected a "
                f"torch.optim.Optimizer. Pass the optimizer, e.g. amp.step(optimizer)."
            )
        clips = f"max_grad_norm={max_grad_norm!r}, max_grad_value={max_grad_value!r}"
        call = f"mixed_precision.step(optimizer, {clips})"
        with validate.arguments(call):
            max_grad_norm, max_grad_value = check_clipping(max_grad_norm, max_grad_value)
        if self.scaler is not None and not self._scaled_backwards:
            raise SpeedupsError(
                "mixed_precision('fp16').step(optimizer): no amp.backward(loss) since the last step, so the "
                "gradients were not made by the GradScaler (a plain loss.backward()?) and unscaling would "
                "shrink them. fp16 needs the scaled backward: replace `loss.backward()` with "
                "`amp.backward(loss)`, then call amp.step(optimizer)."
            )
        self._scaled_backwards = 0
        stepped, _, probe = apply_update(
            (optimizer,),
            self.scaler,
            max_grad_norm,
            1.0,
            skip_nonfinite=False,
            params=lambda: params_of((optimizer,)),
            max_grad_value=max_grad_value,
        )
        self.last_step_skipped = not stepped
        self.found_inf = None if probe is None or self.scaler is None else ~torch.isfinite(probe)
        return stepped

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return ``{"dtype": ..., "scaler": GradScaler state or None}`` for a checkpoint."""
        return {
            "dtype": None if self.dtype is None else str(self.dtype),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the loss scale and its growth tracker).

        Raises:
            ValueError: ``state`` is not such a dict, or was saved with another dtype (a scaler state while
                this object has none, or the reverse).
        """
        self._check_state(state)  # before anything changes
        if state["scaler"] is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _check_state(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing."""
        said = "mixed_precision.load_state_dict(state)"
        if not isinstance(state, dict) or set(state) != {"dtype", "scaler"}:
            raise ValueError(
                f"{said}: expected the dict of mixed_precision.state_dict() "
                f"with keys ['dtype', 'scaler'], got {sorted(state) if isinstance(state, dict) else state!r}."
            )
        if state["scaler"] is not None and not (
            isinstance(state["scaler"], dict) and {"scale", "_growth_tracker"} <= set(state["scaler"])
        ):
            raise ValueError(
                f"{said}: state['scaler'] is not a GradScaler state "
                "(expected a dict with 'scale' and '_growth_tracker'). Pass what state_dict() returned."
            )
        here = None if self.dtype is None else str(self.dtype)
        if state["scaler"] is not None and self.scaler is None:
            raise ValueError(
                f"{said}: the checkpoint has a GradScaler (fp16) but "
                f"this object is {self!r}. Create it with mixed_precision('fp16') to resume."
            )
        if state["dtype"] != here:
            saved = {"torch.bfloat16": "'bf16'", "torch.float16": "'fp16'"}.get(str(state["dtype"]), "")
            fix = (
                f"Create it with mixed_precision({saved}) to resume"
                if saved
                else "Create it with enabled=False"
            )
            raise ValueError(
                f"{said}: saved with dtype {state['dtype']}, this object is {self!r}. {fix}, or leave it "
                f"out of load_checkpoint to change precision on purpose."
            )


def _check_device_type(device_type: object, dtype: object, *, enabled: bool = True) -> str:
    if device_type is None:
        return default_device().type
    said = f"mixed_precision({dtype!r}, device_type={device_type!r})"
    if not isinstance(device_type, str):
        raise TypeError(f"{said}: expected a device type string such as 'cuda' or 'cpu', or None.")
    is_autocast_available = getattr(torch.amp, "is_autocast_available", None)
    try:
        available = is_autocast_available is None or bool(is_autocast_available(device_type))
    except RuntimeError:  # not a device type torch knows at all
        available = False
    if not available or device_type not in _known_device_types():
        raise ValueError(
            f"{said}: not a device type autocast knows. Allowed: {', '.join(_known_device_types()[:4])} "
            f"(those torch autocasts), or None for this process's device. E.g. device_type='cuda'."
        )
    if device_type != "cpu" and enabled:  # enabled=False is a no-op: the device need not exist here
        backend = torch.backends.mps if device_type == "mps" else getattr(torch, device_type, None)
        is_available = getattr(backend, "is_available", None)
        if is_available is None or not is_available():
            raise SpeedupsError(
                f"{said}: this machine has no {device_type} device. "
                f"Use device_type=None (this process's device: {default_device().type})."
            )
    return device_type


def _check_dtype(dtype: object, device_type: str) -> torch.dtype | None:
    """The requested 16-bit dtype, or None for "auto"."""
    said = f"mixed_precision({dtype!r})"
    if isinstance(dtype, str):
        if dtype == "auto":
            return None
        if dtype.lower() in _NAMES:
            return _NAMES[dtype.lower()]
        if dtype.lower() in _OFF:
            return None
        raise ValueError(f"{said}: unknown dtype. Allowed: {_ALLOWED}. E.g. mixed_precision('bf16').")
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
        raise ValueError(
            f"{said}: autocast to {dtype} is not 16-bit mixed precision (torch would silently disable "
            f"autocast or run in full precision). Allowed: {_ALLOWED}. For fp32 use enabled=False."
        )
    raise TypeError(f"{said}: expected a string or a torch.dtype. Allowed: {_ALLOWED}.")


def _check_supported(dtype: object, wanted: torch.dtype, device_type: str) -> None:
    """Raise where torch would warn and silently disable autocast for this dtype on this device type."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(device_type, dtype=wanted)  # construction only: no global state changes
    disabled = [w for w in caught if "disabl" in str(w.message).lower()]
    if disabled:
        raise ValueError(
            f"mixed_precision({dtype!r}, device_type={device_type!r}): torch cannot autocast to {wanted} "
            f"on {device_type} ({str(disabled[0].message).splitlines()[0]}). Use mixed_precision('auto')."
        )


def _auto_dtype(device_type: str) -> tuple[torch.dtype | None, str]:
    """The "auto" choice for ``device_type``, and why when it is fp32."""
    if device_type == "cuda":
        return (torch.bfloat16 if gpu_has_native_bf16() else torch.float16), ""  # not emulated bf16
    if device_type == "cpu":
        if cpu_has_native_bf16():
            return torch.bfloat16, ""
        return None, (
            "this CPU has no native bf16 (no AVX-512 BF16 or AMX), where bf16 autocast is many times slower "
            "than fp32, and fp16 on a CPU is slower still"
        )
    return None, f"'auto' does not choose a 16-bit dtype for {device_type} devices"

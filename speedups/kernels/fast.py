"""One switch for fast fp32 kernels: TF32 matmuls and convolutions, cuDNN autotuning, channels_last.

``fast_kernels(model)`` takes effect when called and stays until ``.restore()`` (or the end of a ``with``
block), which puts back every flag it changed and the memory format of the convolutions it converted (with
their optimizer state: :mod:`speedups.kernels.weight_layout`). The opposite of
:func:`~speedups.deterministic`: each refuses to start while the other is in force.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal, NoReturn

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from speedups._helpers import env, kernel_switches, validate, wrappers
from speedups._helpers.callers import user_line
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.kernels import tf32 as tf32_settings
from speedups.kernels import weight_layout

__all__ = ["fast_kernels"]

Choice = bool | Literal["auto"]
_CONVOLUTIONS = (nn.Conv2d, nn.ConvTranspose2d)  # 4-d weights; Conv1d/Conv3d are left as they are
Convolution = nn.Conv2d | nn.ConvTranspose2d


class fast_kernels:  # lowercase like deterministic and torch.set_grad_enabled: a call that takes effect
    """Make fp32 training faster on NVIDIA GPUs: TF32, cuDNN autotuning and channels_last convolutions.

    ``tf32``: fp32 matmuls and cuDNN convolutions/RNNs use TF32 tensor cores (10-bit mantissa products, fp32
    accumulation; Ampere and later): often several times faster matmuls, results within about 1e-3 relative.
    ``cudnn_benchmark``: ``torch.backends.cudnn.benchmark = True``, cuDNN times its algorithms once per
    input shape and keeps the fastest; it helps when shapes repeat and costs a slow first step per new
    shape. ``channels_last``: the model's ``Conv2d``/``ConvTranspose2d`` weights become
    ``torch.channels_last`` (NHWC), the layout tensor cores and oneDNN prefer; the first convolution turns
    its input to NHWC, and ``x.to(memory_format=torch.channels_last)`` on each batch saves that copy. The
    weights stay the same ``Parameter``s, and their gradients and the state every ``torch.optim.Optimizer``
    holds for them (``exp_avg``, ``momentum_buffer``, ...; found by one scan of live objects) change layout
    with them, there and back, values exact: a fused step pairs elements in memory order. Call it before
    ``ddp_wrap`` and ``torch.compile``. No sync. Sources: NVIDIA's TF32 and tensor-core layout guides,
    PyTorch's performance tuning guide.

    ``"auto"`` (each default) turns a setting on where it applies and leaves it, with one
    :class:`~speedups.SpeedupsWarning` saying why, where it does not (TF32 before Ampere or off CUDA; cuDNN
    off CUDA or under ``torch.use_deterministic_algorithms(True)``; a model without 2-d convolutions).
    ``True`` where it cannot apply raises. :attr:`changed`, :attr:`already` and :attr:`not_applied` say what
    happened; ``print()`` shows them. ``restore()`` (or leaving the ``with`` block) puts back each flag
    changed (with the older and newer TF32 settings both, exactly) and makes converted weights (and their
    optimizer state) contiguous again. Nested switches restore newest first: an older one's ``restore()``
    while a newer one is in force raises, changing nothing. Not a decorator: ``@fast_kernels(model)`` raises
    ``TypeError`` once what the call changed is put back. ``enabled=False`` changes nothing.

    Args:
        model: the ``nn.Module`` whose convolutions to convert (before any DDP wrapping), or None.
        tf32: True, False or ``"auto"``.
        cudnn_benchmark: True, False or ``"auto"``.
        channels_last: True, False or ``"auto"`` (needs ``model``).
        enabled: False: a no-op.

    Raises:
        TypeError, ValueError: a bad argument (nothing is changed then); used as a decorator; a model
            already wrapped in DDP (given itself, or the model inside it) with convolutions to convert.
        SpeedupsError: a ``True`` that cannot apply here; :func:`~speedups.deterministic` in force;
            ``with`` on a switch already restored; ``restore()`` while a newer ``fast_kernels`` is in force.

    Example:
        >>> conv = nn.Conv2d(3, 8, 3)
        >>> with fast_kernels(conv, tf32=False, cudnn_benchmark=False) as switch:
        ...     conv.weight.is_contiguous(memory_format=torch.channels_last), switch.convolutions
        (True, 1)
        >>> conv.weight.is_contiguous(), switch.active
        (True, False)
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        tf32: Choice = "auto",
        cudnn_benchmark: Choice = "auto",
        channels_last: Choice = "auto",
        enabled: bool = True,
    ) -> None:
        shown = type(model).__name__ + "(...)" if isinstance(model, nn.Module) else validate.short(model)
        said = f"fast_kernels({shown}, tf32={tf32!r}, cudnn_benchmark={cudnn_benchmark!r}"
        said += f", channels_last={channels_last!r}, enabled={enabled!r})"
        self._said = said
        self._where = user_line()  # names this switch in messages beside others made alike
        if callable(model) and not isinstance(model, nn.Module):
            name = getattr(model, "__qualname__", validate.short(model))
            raise TypeError(
                f"@fast_kernels on {name}: fast_kernels is a switch, not a decorator, and takes the model; "
                f"nothing was changed. Write it inside the function: with fast_kernels(model): ..."
            )
        with validate.arguments(said):
            validate.flag(enabled, "enabled")
            for name, value in (
                ("tf32", tf32),
                ("cudnn_benchmark", cudnn_benchmark),
                ("channels_last", channels_last),
            ):
                _check_choice(value, name)
            validate.instance(model, nn.Module, "model", what="a torch.nn.Module", none_ok=True)
            convolutions = _convolutions(model, channels_last)
        self.enabled = enabled
        self.tf32, self.cudnn_benchmark, self.channels_last = tf32, cudnn_benchmark, channels_last
        self.changed: dict[str, tuple[Any, Any]] = {}
        """What the call set: name -> (value before, value set)."""
        self.already: list[str] = []
        """What was asked for and already so (nothing to change), in words."""
        self.not_applied: dict[str, str] = {}
        """The settings left as they are because they do not apply here: name -> why."""
        self.convolutions = 0
        """How many convolutions' weights the call turned to channels_last."""
        self.optimizer_state = 0
        """How many optimizer state tensors (``exp_avg``, ``momentum_buffer``, ...) followed their weights."""
        self._undo: list[Callable[[], None]] | None = None
        if not enabled:
            return
        self._check_environment(convolutions, model)
        self._apply(convolutions)

    @property
    def active(self) -> bool:
        """Whether the settings are in force (called with ``enabled=True`` and not yet restored)."""
        return self._undo is not None

    def _check_environment(self, convolutions: list[Convolution], model: nn.Module | None) -> None:
        """Refuse what cannot apply here, and note what ``"auto"`` leaves; nothing is changed yet."""
        opposite = kernel_switches.find("deterministic")
        if opposite is not None:
            raise SpeedupsError(
                f"{self._said}: the deterministic(seed={getattr(opposite, 'seed', None)!r}) made at "
                f"{kernel_switches.made_at(opposite)} is in force, and fast kernels undo it (cuDNN "
                f"autotuning picks algorithms by timing, so they differ from run to run; TF32 changes fp32 "
                f"results). Restore it first: switch.restore() (or leave its with block), then "
                f"fast_kernels(...); or keep the reproducible run as it is."
            )
        device = env.device()
        where = f"this device: {device}"
        if device.type != "cuda":
            tf32_why = f"TF32 runs on NVIDIA GPUs of compute capability 8.0 (Ampere) or later; {where}"
        elif torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            tf32_why = f"TF32 needs an NVIDIA GPU of compute capability 8.0 (Ampere) or later; {where} is "
            tf32_why += f"{major}.{minor}"
        else:
            tf32_why = ""
        if device.type != "cuda" or not torch.backends.cudnn.is_available():
            cudnn_why = f"cuDNN runs on CUDA devices only; {where}"
        elif torch.are_deterministic_algorithms_enabled():
            cudnn_why = (
                "torch.use_deterministic_algorithms(True) is on, and autotuning picks cuDNN's algorithm by "
                "timing, so it can differ from run to run"
            )
        else:
            cudnn_why = ""
        if model is None:
            layout_why = ""  # nothing asked: no warning
        elif not convolutions:
            layout_why = f"{type(model).__name__} has no 2-d convolutions (nn.Conv2d, nn.ConvTranspose2d)"
        else:
            layout_why = ""
        fixes = {"tf32": "tf32='auto'", "cudnn_benchmark": "cudnn_benchmark='auto'"}
        for name, asked, why in (
            ("tf32", self.tf32, tf32_why),
            ("cudnn_benchmark", self.cudnn_benchmark, cudnn_why),
        ):
            if why and asked is True:
                raise SpeedupsError(
                    f"{self._said}: {name}=True cannot apply here: {why}. Pass {fixes[name]} (on only where "
                    f"it applies) or {name}=False."
                )
            if why and asked == "auto":
                self.not_applied[name] = why
        if layout_why and self.channels_last == "auto":
            self.not_applied["channels_last"] = layout_why

    def _apply(self, convolutions: list[Convolution]) -> None:
        undo: list[Callable[[], None]] = []
        try:
            if self.tf32 is not False and "tf32" not in self.not_applied:
                for allow, what in (
                    (tf32_settings.allow_matmul, "TF32 for fp32 matmuls"),
                    (tf32_settings.allow_cudnn, "TF32 for cuDNN"),
                ):
                    change = allow()
                    if change is None:
                        self.already.append(what)
                    else:
                        undo.append(change.undo)
                        self.changed.update(change.settings)
            if self.cudnn_benchmark is not False and "cudnn_benchmark" not in self.not_applied:
                cudnn = torch.backends.cudnn
                if cudnn.benchmark:
                    self.already.append("torch.backends.cudnn.benchmark")
                else:
                    cudnn.benchmark = True
                    undo.append(lambda: setattr(cudnn, "benchmark", False))
                    self.changed["torch.backends.cudnn.benchmark"] = (False, True)
            if self.channels_last is not False and convolutions:
                undo.append(self._to_channels_last(convolutions))
        except BaseException:
            for step in reversed(undo):
                step()
            self.changed, self.already, self.convolutions = {}, [], 0
            raise
        self._undo = undo
        kernel_switches.enter("fast_kernels", self, self._said, self._where)
        if self.not_applied and env.rank() == 0:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.not_applied.items())
            off = ", ".join(f"{name}=False" for name in self.not_applied)
            warnings.warn(
                f"{self._said}: left as they are, since they do not apply here: {reasons}. Pass {off} to "
                f"silence this.",
                SpeedupsWarning,
                stacklevel=3,
            )

    def _to_channels_last(self, convolutions: list[Convolution]) -> Callable[[], None]:
        """Turn each contiguous conv weight to channels_last, with its gradient and the optimizer state made
        for it (:mod:`speedups.kernels.weight_layout`); return what turns them back."""
        fmt = torch.channels_last
        subclassed = [m for m in convolutions if type(m.weight.data) is not torch.Tensor]  # DTensor, ...
        if subclassed:
            kinds = sorted({type(m.weight.data).__name__ for m in subclassed})
            self.already.append(
                f"{_count(len(subclassed))} with {', '.join(kinds)} weights (sharded or a tensor subclass), "
                f"left as they are: convert before sharding"
            )
            convolutions = [m for m in convolutions if type(m.weight.data) is torch.Tensor]
        todo = [
            m
            for m in convolutions
            if m.weight.is_contiguous() and not m.weight.is_contiguous(memory_format=fmt)
        ]
        done = [m for m in convolutions if m.weight.is_contiguous(memory_format=fmt)]  # 1x1 kernels: both
        if len(done) + len(todo) < len(convolutions):
            odd = len(convolutions) - len(done) - len(todo)
            self.already.append(
                f"{_count(odd)} with weights neither contiguous nor channels_last, left as they are"
            )
        if any(not m.weight.is_contiguous() for m in done):
            self.already.append(f"{_count(sum(not m.weight.is_contiguous() for m in done))} in channels_last")
        # The same Parameters (an optimizer holds them), their gradients and optimizer state along
        self.optimizer_state = weight_layout.relayout(_weights(todo), fmt)
        self.convolutions = len(todo)
        if todo:
            self.changed["channels_last"] = (torch.contiguous_format, fmt)

        def undo() -> None:
            weight_layout.relayout(_weights(todo), torch.contiguous_format)

        return undo

    def restore(self) -> None:
        """Put back what the call changed: the flags, and the memory format of the weights it converted.

        The optimizer state of the converted weights (in every ``torch.optim.Optimizer`` that holds them,
        found by one scan of live objects) follows them back to the contiguous layout, values exact. A second
        call (or one after ``enabled=False``) does nothing.

        Raises:
            SpeedupsError: a ``fast_kernels`` switch made after this one is still in force (restore newest
                first); nothing is changed then.
        """
        if self._undo is None:
            return
        kernel_switches.check_order(self, self._said)
        undo, self._undo = self._undo, None
        kernel_switches.leave(self)
        for step in reversed(undo):
            step()

    def __enter__(self) -> fast_kernels:
        if self.enabled and self._undo is None:
            raise SpeedupsError(
                f"with {self._said}: this switch was already restored, and a switch takes effect when it is "
                f"made. Make a new one: with fast_kernels(model): ..."
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        """Refuse use as a decorator (``@fast_kernels(model)``), once what the call changed is put back.

        A decorator could not undo what the switch did when the decorator line made it, and a fresh switch
        per call would convert the weights and their optimizer state there and back at every call.

        Raises:
            TypeError: always, saying how to write it.
        """
        raise kernel_switches.not_a_decorator(
            self, self._said, args[0] if args else None, self.restore, "with fast_kernels(model): ..."
        )

    def __repr__(self) -> str:
        state = "active" if self.active else "off" if not self.enabled else "restored"
        lines = [f"{self._said.split(', enabled=')[0]}): {state}"]
        for name, (old, new) in self.changed.items():
            count = f" ({_count(self.convolutions)})" if name == "channels_last" else ""
            if name == "channels_last" and self.optimizer_state:
                count = f" ({_count(self.convolutions)}, {self.optimizer_state} optimizer state tensors)"
            lines.append(f"  set {name}{count}: {old!r} -> {new!r}")
        lines += [f"  already so: {what}" for what in self.already]
        lines += [f"  not applicable here: {name}: {why}" for name, why in self.not_applied.items()]
        return "\n".join(lines)


def _weights(convolutions: list[Convolution]) -> list[torch.Tensor]:
    """The convolutions' weights, each once (a weight shared by two convolutions is one tensor)."""
    unique: dict[int, torch.Tensor] = {}
    for module in convolutions:
        unique.setdefault(id(module.weight), module.weight)
    return list(unique.values())


def _count(n: int) -> str:
    return f"{n} convolution" + ("" if n == 1 else "s")


def _check_choice(value: object, name: str) -> None:
    if isinstance(value, bool) or value == "auto":
        return
    kind = TypeError if not isinstance(value, str) else ValueError
    raise kind(f"{name}={validate.short(value)}: expected True, False or 'auto'. Write {name}='auto'.")


def _convolutions(model: nn.Module | None, channels_last: object) -> list[Convolution]:
    """The model's 2-d convolutions with a 4-d weight (lazy ones not yet run are skipped); checks the ask."""
    if channels_last is False:
        return []
    if model is None:
        if channels_last is True:
            raise ValueError(
                "channels_last=True converts a model's convolutions, and no model was given. Pass it: "
                "fast_kernels(model)."
            )
        return []
    for layer in wrappers.layers(model):
        if isinstance(layer, (DistributedDataParallel, DataParallel)):
            raise ValueError(
                f"model is wrapped in {type(layer).__name__}, whose gradient buckets were laid out for the "
                f"weights' memory format when it wrapped them. Convert first: fast_kernels(model), then "
                f"ddp_wrap(model); or pass channels_last=False."
            )
    found: list[Convolution] = [
        m
        for m in model.modules()
        if isinstance(m, _CONVOLUTIONS)
        and isinstance(m.weight, torch.Tensor)
        and not isinstance(m.weight, nn.parameter.UninitializedParameter)
        and m.weight.dim() == 4
    ]
    outer = wrappers.live_wrapper_of({id(m.weight) for m in found}) if found else None
    if outer is not None:  # the model given is the one inside: its DDP was made already
        raise ValueError(
            f"model is already wrapped in a {type(outer).__name__}, made for the weights' memory format as "
            f"it was (DDP lays its gradient buckets out for it and does not follow a later change: training "
            f"then goes wrong without an error). Convert first: fast_kernels(model), then ddp_wrap(model); "
            f"or pass channels_last=False."
        )
    if not found and channels_last is True:
        raise ValueError(
            f"channels_last=True converts 2-d convolutions, and {type(model).__name__} has none (nn.Conv2d, "
            f"nn.ConvTranspose2d, run once if lazy). Pass channels_last=False or 'auto'."
        )
    return found

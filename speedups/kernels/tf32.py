"""TF32 for fp32 matmuls and cuDNN, turned on and put back through whichever API the installed torch has.

torch 2.9 added per-operation settings (``torch.backends.cuda.matmul.fp32_precision``,
``torch.backends.cudnn.conv.fp32_precision`` and ``.rnn``) beside the older ones
(``torch.set_float32_matmul_precision``, ``torch.backends.cudnn.allow_tf32``), and keeps both views: a
state set through the new settings alone that the old ones cannot express makes torch's own readers of the
old ones raise "you have used mix of the legacy and new APIs" (``torch.get_float32_matmul_precision()``,
which inductor's autotuning cache calls; ``torch.backends.cudnn.allow_tf32``, which inductor's convolution
templates read). So where the new settings exist they are read and put back exactly, and TF32 is turned on
through the old call, which sets both views together, unless the views already disagree (then through the
new settings only, as they were left). Older torch has only the old settings. Detected by feature.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Change", "allow_cudnn", "allow_matmul", "cudnn_allowed", "matmul_allowed"]

# The notes page torch 2.9's notice on its older TF32 calls links to ("Please use the new API settings to
# control TF32 behavior ..."); later releases dropped the notice (torch 2.14 has none).
_NOTICE = "tensorfloat-32-tf32-on-ampere"


@dataclass
class Change:
    """What one ``allow_*`` call changed: each setting as (value before, value set); how to put it back."""

    settings: dict[str, tuple[Any, Any]]
    undo: Callable[[], None]


def _old(call: Callable[..., Any], *args: Any) -> Any:
    """Call one of torch's older TF32 functions without its deprecation notice; other warnings pass on.

    The notice asks for the newer settings, which are read and set alongside (see the module docstring).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(*args)
    for warning in caught:
        if _NOTICE not in str(warning.message):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return result


def _readable(read: Callable[[], Any]) -> Any | None:
    """``read()`` through :func:`_old`, or None where torch refuses to read a state set by mixing the APIs."""
    try:
        return _old(read)
    except RuntimeError:
        return None


def _precision(owner: Any) -> bool:
    return owner is not None and hasattr(owner, "fp32_precision")


def matmul_allowed() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 now, through whichever settings torch has (changes nothing).

    Where torch has the newer settings they decide (the older view may refuse to be read, see the module
    docstring); before torch 2.9, ``"high"`` or ``"medium"`` matmul precision is TF32 or faster.
    """
    cuda = torch.backends.cuda.matmul
    if not _precision(cuda):  # before torch 2.9: the one older setting
        return bool(torch.get_float32_matmul_precision() != "highest")
    return bool(cuda.fp32_precision == "tf32")


def cudnn_allowed() -> bool:
    """Whether cuDNN's fp32 convolutions and RNNs may both use TF32 now (changes nothing; torch's default)."""
    cudnn = torch.backends.cudnn
    conv, rnn = getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)
    if not (_precision(conv) and _precision(rnn)):  # before torch 2.9: the one older setting
        return bool(cudnn.allow_tf32)
    assert conv is not None and rnn is not None  # for mypy: _precision checked them
    return bool((conv.fp32_precision, rnn.fp32_precision) == ("tf32", "tf32"))


def allow_matmul() -> Change | None:
    """Let fp32 matmuls on CUDA use TF32; return what changed, or None when they already may."""
    if matmul_allowed():
        return None
    cuda = torch.backends.cuda.matmul
    if not _precision(cuda):  # before torch 2.9: the one older setting ("highest")
        torch.set_float32_matmul_precision("high")
        return Change(
            {"torch.set_float32_matmul_precision": ("highest", "high")},
            lambda: torch.set_float32_matmul_precision("highest"),
        )
    before = cuda.fp32_precision
    cpu = getattr(torch.backends.mkldnn, "matmul", None)
    cpu = cpu if _precision(cpu) else None  # the old call also sets oneDNN's (CPU) matmuls: kept as they are
    cpu_before = None if cpu is None else cpu.fp32_precision
    old = _readable(torch.get_float32_matmul_precision)
    settings: dict[str, tuple[Any, Any]] = {"torch.backends.cuda.matmul.fp32_precision": (before, "tf32")}
    if old is None:  # the views disagree already: change the new setting only
        cuda.fp32_precision = "tf32"
    else:
        target = "medium" if old == "medium" else "high"  # "medium" (bf16 on the CPU) is kept
        _old(torch.set_float32_matmul_precision, target)
        if cpu is not None and cpu.fp32_precision != cpu_before:
            cpu.fp32_precision = cpu_before
        if target != old:
            settings["torch.set_float32_matmul_precision"] = (old, target)

    def undo() -> None:
        if old is not None:
            _old(torch.set_float32_matmul_precision, old)
        cuda.fp32_precision = before
        if cpu is not None:
            cpu.fp32_precision = cpu_before

    return Change(settings, undo)


def allow_cudnn() -> Change | None:
    """Let cuDNN's fp32 convolutions and RNNs use TF32; return what changed, or None when they already may.

    torch's default already allows it; only a run that turned it off is changed.
    """
    if cudnn_allowed():
        return None
    cudnn = torch.backends.cudnn
    conv, rnn = getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)
    if not (_precision(conv) and _precision(rnn)):  # before torch 2.9: the one older setting (False)
        cudnn.allow_tf32 = True
        return Change(
            {"torch.backends.cudnn.allow_tf32": (False, True)}, lambda: setattr(cudnn, "allow_tf32", False)
        )
    assert conv is not None and rnn is not None  # for mypy: _precision checked them
    before = (conv.fp32_precision, rnn.fp32_precision)
    old = _readable(lambda: cudnn.allow_tf32)
    if old is None:  # the views disagree already: change the new settings only
        conv.fp32_precision = rnn.fp32_precision = "tf32"
    else:
        _old(setattr, cudnn, "allow_tf32", True)  # sets conv, rnn and the older flag together

    def undo() -> None:
        if old is not None:
            _old(setattr, cudnn, "allow_tf32", old)
        conv.fp32_precision, rnn.fp32_precision = before

    settings: dict[str, tuple[Any, Any]] = {
        "torch.backends.cudnn.conv.fp32_precision": (before[0], "tf32"),
        "torch.backends.cudnn.rnn.fp32_precision": (before[1], "tf32"),
    }
    if old is False:
        settings["torch.backends.cudnn.allow_tf32"] = (False, True)
    return Change({k: v for k, v in settings.items() if v[0] != v[1]}, undo)

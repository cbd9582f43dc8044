"""What the five-loop races share: the peers' precision names, finding them, and ratios paired within a
repetition (``end_to_end.py``, ``language_model.py``)."""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

# autocast dtype -> (Accelerate's mixed_precision, Fabric's precision)
PRECISION = {
    torch.bfloat16: ("bf16", "bf16-mixed"),
    torch.float16: ("fp16", "16-mixed"),
    None: ("no", "32-true"),
}


class Timed(Protocol):
    seconds: float


def fabric_class() -> type:
    """Lightning Fabric's ``Fabric``, from ``lightning`` or the standalone ``lightning-fabric`` package."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    return Fabric


def missing_peers() -> dict[str, str]:
    """The peer rows that cannot run here, with why."""
    missing = {}
    if importlib.util.find_spec("accelerate") is None:
        missing["accelerate"] = "not installed (pip install -e '.[bench]')"
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("lightning_fabric") is None:
        missing["fabric"] = "not installed (pip install -e '.[bench]')"
    return missing


def paired(done: Mapping[str, Sequence[Timed]], num: str, den: str) -> list[float] | None:
    """``num``'s time over ``den``'s, per repetition (run minutes apart at most, so a machine that gets busier
    or quieter between repetitions moves both alike); None if either row is missing."""
    if num not in done or den not in done:
        return None
    return [a.seconds / b.seconds for a, b in zip(done[num], done[den], strict=True)]


def median(ratios: list[float] | None) -> float | None:
    return None if ratios is None else statistics.median(ratios)


def fmt(ratio: float | None) -> str:
    """A ratio as the last line prints it: ``1.23x``, or ``n/a``."""
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def shown(ratios: list[float] | None) -> str:
    """The median ratio with its range over the repetitions: ``1.23x (1.10-1.30)``."""
    if ratios is None:
        return "n/a"
    spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"

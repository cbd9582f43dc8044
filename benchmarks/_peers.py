"""What the five-loop races share: the peers' precision names, finding them, and ratios paired within a
repetition (``end_to_end.py``, ``language_model.py``)."""

from __future__ import annotations

import gc
import importlib.util
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import torch

# autocast dtype -> (Accelerate's mixed_precision, Fabric's precision)
PRECISION = {
    torch.bfloat16: ("bf16", "bf16-mixed"),
    torch.float16: ("fp16", "16-mixed"),
    None: ("no", "32-true"),
}


class Timed(Protocol):
    seconds: float


class Raced(Timed, Protocol):
    reached: bool
    notes: str


R = TypeVar("R", bound=Raced)


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


def race(
    run: Callable[[str, int], R],
    chosen: Sequence[str],
    reps: int,
    threads: int,
    before_each: Callable[[], None] | None = None,
) -> tuple[dict[str, list[R]], dict[str, str]]:
    """Run each row of ``chosen`` once per repetition, interleaved (each repetition in a rotated order):
    ``run(name, rep)``. The peers that are not installed, and a row that raises (its first line kept), are
    skipped with why; the others go on. Before each row: ``threads`` compute threads (a library must not
    change them for the next row) and ``before_each()``; after it, a collection (ending its loader workers).
    Returns ``(done, skipped)``: each row that ran and was not skipped with its outcomes, in repetition order.
    """
    skipped = missing_peers()
    names = [n for n in chosen if n not in skipped]
    results: dict[str, list[R]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if name in skipped:
                continue
            torch.set_num_threads(threads)
            if before_each is not None:
                before_each()
            try:
                results[name].append(run(name, rep))
            except Exception as err:  # a row that cannot run says why; the others go on
                skipped[name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            gc.collect()
    torch.set_num_threads(threads)
    return {n: r for n, r in results.items() if r and n not in skipped}, skipped


def notes(
    done: Mapping[str, Sequence[R]],
    skipped: Mapping[str, str],
    final: Callable[[Sequence[R]], str],
    limit: str,
) -> list[str]:
    """The lines under the table: each row's notes and ``final(runs)``, the repetitions that missed the
    target (timed to ``limit`` instead), and the rows skipped with why."""
    out = []
    for name, runs in done.items():
        out.append(f"  {name}: {runs[-1].notes}; {final(runs)}")
        missed = sum(not o.reached for o in runs)
        if missed:
            out.append(f"  * {name} missed the target in {missed} of {len(runs)} repetition(s) "
                       f"(time to {limit} shown)")  # fmt: skip
    out += [f"{name}: skipped: {why}" for name, why in skipped.items()]
    return out

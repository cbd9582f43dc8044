"""The levers of the seam matrix: one row each. A new lever is one row here (and its two spellings in
``loops.py``): every pair it makes with the others is then run against the hand-written loop.

Each lever sets fields of a :class:`~tests.seams.loops.Recipe`, with the defaults a user gets: inductor for
``compile_blocks``, fast_loader's own persistent workers, Adam's fused and foreach implementations beside
its for-loop, a dataset that changes, bf16 on this CPU. ``tolerance`` is the largest difference of the
weights, buffers and losses it allows from the plain loop (0: bitwise; float rounding of another order of
operations: 1e-5; the plain loop compiles the same blocks by hand, ``block.compile()``, so inductor's
kernels are on both sides); a pair takes the larger of its two. The global RNG state must always be equal.
``slow`` levers (worker processes, inductor, a save and a resume) make their pairs slow.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from tests.seams.loops import Recipe


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    fields: dict[str, Any]
    tolerance: float
    slow: bool = False
    ddp: bool = True  # whether it also runs beside DDP on 2 gloo ranks

    def apply(self, recipe: Recipe) -> Recipe:
        return dataclasses.replace(recipe, **self.fields)


LEVERS = [
    Lever("workers", {"workers": 2}, 0.0, slow=True),
    Lever("stateful-dataset", {"stateful": True}, 0.0),
    Lever("accumulate", {"every": 2}, 1e-5),
    Lever("micro-batches", {"micro": 4}, 1e-5),
    Lever("auto-micro-batches-oom", {"micro": "auto", "oom_above": 4}, 1e-5),
    Lever("bf16", {"bf16": True}, 1e-5),
    Lever("loss-tracker", {"tracker": True}, 1e-6),
    Lever("clip", {"clip": 0.05}, 1e-5),
    Lever("compile-blocks-inductor", {"compile": True}, 1e-5, slow=True, ddp=False),
    Lever("checkpoint-activations", {"checkpoint": True}, 1e-5),
    Lever("fast-kernels-restored", {"fast_kernels": True}, 1e-5),
    Lever("adam-fused", {"optimizer": "fused"}, 1e-5),
    Lever("adam-foreach", {"optimizer": "foreach"}, 1e-5),
    Lever("resume-mid-window", {"resume_at": 3}, 1e-5, slow=True),
]

# Pairs that are not one loop a user may write, each with why.
EXCLUDED: dict[frozenset[str], str] = {
    frozenset({"micro-batches", "auto-micro-batches-oom"}): "one micro_batch_size or the other",
    frozenset({"adam-fused", "adam-foreach"}): "one Adam implementation or the other",
    frozenset({"stateful-dataset", "resume-mid-window"}): (
        "without workers, the dataset's own generator advances in the main process, state no checkpoint of "
        "speedups holds (the user's dataset's to save); with workers it is the (workers, stateful) pair's"
    ),
}


def pairs() -> list[tuple[Lever, Lever]]:
    """Every pair of levers a user may combine, in the table's order."""
    return [
        (a, b) for a, b in itertools.combinations(LEVERS, 2) if frozenset({a.name, b.name}) not in EXCLUDED
    ]


def recipe_of(*levers: Lever) -> Recipe:
    recipe = Recipe()
    for lever in levers:
        recipe = lever.apply(recipe)
    return recipe

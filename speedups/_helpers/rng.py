"""Save and restore the global random number generators (torch CPU, CUDA, MPS, numpy, random).

Used by tools that run the user's code to measure something (``tune_loader``, ``find_batch_size``) and must
leave the random streams exactly where they were, so that the training run that follows draws the same
numbers as it would have without the measurement.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["get_rng_states", "set_rng_states", "preserved_rng"]


def numpy_or_none() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional for speedups
        return None
    return numpy


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available() and hasattr(torch, "mps"))


def get_rng_states() -> dict[str, Any]:
    """Return copies of the global RNG states: torch CPU, each CUDA device (if used), MPS, numpy, random.

    CUDA states are read only when CUDA is already initialised, so that a CPU-only run never creates a
    CUDA context.
    """
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if mps_available():
        states["mps"] = torch.mps.get_rng_state()
    np = numpy_or_none()
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back the states returned by :func:`get_rng_states`."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states:
        torch.mps.set_rng_state(states["mps"])
    if "numpy" in states:
        numpy_or_none().random.set_state(states["numpy"])


@contextlib.contextmanager
def preserved_rng(*generators: torch.Generator | None) -> Iterator[None]:
    """Run a block, then restore the global RNG states and the states of ``generators`` (None is skipped)."""
    saved = get_rng_states()
    own = [(g, g.get_state()) for g in generators if g is not None]
    try:
        yield
    finally:
        set_rng_states(saved)
        for g, state in own:
            g.set_state(state)

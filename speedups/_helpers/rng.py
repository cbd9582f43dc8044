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

__all__ = [
    "get_rng_states",
    "set_rng_states",
    "preserved_rng",
    "epoch_seed",
    "mix64",
    "sample_seed",
    "seed_in_epoch",
    "seed_host_rngs",
    "host_rng_states",
    "set_host_rng_states",
]

_MASK64 = (1 << 64) - 1


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


def mix64(z: int) -> int:
    """SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014): nearby inputs give unrelated 64-bit outputs."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample ``index`` in ``epoch`` of a run seeded with ``seed`` (a pure function)."""
    return seed_in_epoch(epoch_seed(seed, epoch), index)


def seed_in_epoch(shared: int, index: int) -> int:
    """:func:`sample_seed` from its epoch's :func:`epoch_seed` (``shared``): the per-item part."""
    return mix64(shared ^ (index & _MASK64))


def epoch_seed(seed: int, epoch: int) -> int:
    """The part of :func:`sample_seed` shared by every sample of an epoch (computed once per batch)."""
    return mix64(mix64(seed & _MASK64) ^ (epoch & _MASK64))


def seed_host_rngs(value: int, np: Any = None) -> None:
    """Seed torch's CPU generator, ``random`` and numpy's global ``RandomState`` from one 64-bit value.

    Each gets other bits of it (torch's Mersenne Twister reads the low 32, numpy the high 32, ``random``
    all 64), so the three streams are not the same numbers. ``np`` is the numpy module (None: looked up;
    absent: not seeded). About 6 us.
    """
    torch.default_generator.manual_seed(value)  # not torch.manual_seed: that also queues every CUDA device
    random.seed(value)
    np = numpy_or_none() if np is None else np
    if np is not None:
        np.random.seed(value >> 32)


def host_rng_states() -> tuple[Any, ...]:
    """The states :func:`seed_host_rngs` changes: torch CPU, ``random``, numpy (None without numpy)."""
    np = numpy_or_none()
    return (
        torch.default_generator.get_state(),
        random.getstate(),
        None if np is None else np.random.get_state(),
    )


def set_host_rng_states(states: tuple[Any, ...]) -> None:
    """Put back what :func:`host_rng_states` returned."""
    torch_state, random_state, numpy_state = states
    torch.default_generator.set_state(torch_state)
    random.setstate(random_state)
    if numpy_state is not None:
        numpy_or_none().random.set_state(numpy_state)

"""One seed for every random stream a training script draws from, the same on every rank."""

from __future__ import annotations

import random

import torch

from speedups._helpers import validate

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy (if installed), and torch on the CPU and every CUDA device.

    Call it once at the start, with the same seed on every rank: models then start identical (DDP also
    broadcasts rank 0's weights) and :func:`~speedups.distributed` loaders agree on the order. Dropout
    masks are then the same on every rank too; add the rank (``seed + rank``) after wrapping if that
    matters to you. DataLoader workers follow: torch seeds each worker's torch, ``random`` and numpy from
    a base seed drawn from the global torch RNG (or the loader's ``generator``) every epoch.
    :class:`~speedups.deterministic` seeds through it and also makes torch's kernels deterministic.

    Args:
        seed: an int in [0, 2**32 - 1] (NumPy's range).

    Returns:
        The seed.

    Raises:
        TypeError: ``seed`` is not an int.
        ValueError: ``seed`` is out of range.

    Example:
        >>> _ = seed_everything(3); a = torch.rand(2)
        >>> _ = seed_everything(3); bool((a == torch.rand(2)).all())
        True
    """
    with validate.arguments(f"seed_everything(seed={seed!r})"):
        fix = "0 (NumPy's range: 0 to 2**32 - 1)"
        validate.integer(seed, "seed", minimum=0, maximum=2**32 - 1, example=fix)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    return seed

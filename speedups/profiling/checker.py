"""``check()``: a profiler that watches for the classic training-loop mistakes, sampling every step."""

from __future__ import annotations

import torch

from speedups.profiling.profiler import StepProfiler

__all__ = ["check"]


def check(*, model: torch.nn.Module | None = None, enabled: bool = True) -> StepProfiler:
    """Watch a loop for the classic mistakes; each warns once (a ``SpeedupsWarning``) with the fix as code.

    Same as ``profile_steps(debug=True, model=model)``::

        with check(model=ddp_model) as chk:
            for batch in chk.iter(loader):
                ...

    Detects: a loss tensor kept alive with its autograd graph across steps; a ``DistributedSampler``
    iterated again with the same epoch (``set_epoch`` forgotten); ``no_sync()`` around backward but not
    forward (``model`` must be the DDP-wrapped model). Slower than plain profiling: every step is sampled.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``enabled`` is not a bool (the message names
            ``profile_steps``, which makes the checker).
        SpeedupsError: the same checker is entered twice.

    Example:
        >>> import warnings
        >>> model = torch.nn.Linear(2, 1)
        >>> losses = []
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     with check() as chk:
        ...         for x in chk.iter([torch.randn(4, 2) for _ in range(3)]):
        ...             loss = model(x).pow(2).mean()
        ...             loss.backward()
        ...             losses.append(loss)  # the mistake: keeps each step's graph
        >>> any("losses.append(loss.detach())" in str(w.message) for w in caught)
        True
    """
    return StepProfiler(debug=True, model=model, enabled=enabled)

"""The exception and warning classes of speedups.

Bad arguments raise the built-in ``ValueError`` or ``TypeError``; misuse of state or of the environment
(a device that is not there, a value read before anything was recorded) raises :class:`SpeedupsError`.
An ``"auto"`` choice that does not apply on this machine degrades to a no-op with one
:class:`SpeedupsWarning` that says why.
"""

from __future__ import annotations

__all__ = ["SpeedupsError", "SpeedupsWarning"]


class SpeedupsError(RuntimeError):
    """Misuse of state or environment: the call was well formed, but cannot work here or now.

    Examples: moving to ``"cuda:7"`` on a machine with one GPU, reading a :class:`~speedups.LossTracker`
    that never received a value.
    """


class SpeedupsWarning(UserWarning):
    """A speedup was asked for ``"auto"`` and does not apply here, or a value was handled by a documented
    policy (for example a non-finite loss left out of a mean)."""

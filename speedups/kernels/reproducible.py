"""One switch for a reproducible run: torch's deterministic algorithms, cuDNN and cuBLAS settings, and seeds.

``deterministic(seed=0)`` takes effect when called and stays until ``.restore()`` (or the end of a ``with``
block), which puts back every flag, the environment variable and the random states it replaced.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NoReturn

import torch

from speedups._helpers import env, kernel_switches, validate
from speedups._helpers.callers import user_line
from speedups._helpers.rng import get_rng_states, set_rng_states
from speedups.errors import SpeedupsError, SpeedupsWarning
from speedups.parallel.seeding import seed_everything

__all__ = ["CUBLAS_CONFIG", "deterministic"]

CUBLAS_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
"""The environment variable cuBLAS reads for its workspace; ``:4096:8`` or ``:16:8`` make it deterministic."""
_DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
_MAX_SEED = 2**32 - 1  # seed_everything's range (NumPy's)


class deterministic:  # lowercase like torch.set_grad_enabled: a call that takes effect, and a context manager
    """Make this process's run reproducible where torch can: the same seed and inputs give the same bits.

    Sets ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark = False``,
    ``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    (kept if already ``:4096:8`` or ``:16:8``), then seeds ``random``, numpy and torch (CPU and every
    CUDA device) with ``seed`` (``seed + rank`` with ``per_rank=True``). Every rank calls it. Loader workers
    follow: torch seeds each from a base seed drawn from the main process's RNG (or the loader's
    ``generator``) every epoch. Costs speed where torch then picks slower deterministic kernels (cuDNN
    convolutions, scatter/index_add on CUDA); on the CPU, nothing. No sync.

    Not deterministic with it: an op torch has no deterministic kernel for raises ``RuntimeError`` when
    called (``warn_only=True``: a warning naming it); cuBLAS, when CUDA was initialised before the variable
    was set (a :class:`~speedups.SpeedupsWarning`: call this first, or export the variable); another number
    of compute threads (``torch.set_num_threads``), processes, loader workers (augmentation follows the
    worker that loads the item, unless ``fast_loader(..., sample_seeds=True)``), torch version or hardware.
    :attr:`limits` lists them; ``print()`` shows what was changed and the limits.

    ``restore()`` (or leaving the ``with`` block) puts back the flags, the variable (removed if it was
    unset) and the global random states of before the call (CUDA's if it was initialised). Nested switches
    restore newest first: an older one's ``restore()`` while a newer one is in force raises, changing
    nothing. ``enabled=False`` changes nothing. Refused while :func:`~speedups.fast_kernels` is in force (it
    sets the opposite flags), and refuses it. Not a decorator: ``@deterministic(seed=0)`` raises
    ``TypeError`` once what the call changed is put back; write ``with deterministic(seed=0):`` inside.

    Args:
        seed: an int in [0, 2**32 - 1]; None leaves the random states as they are.
        per_rank: seed each rank with ``seed + rank`` (its own dropout masks and noise).
        warn_only: ops without a deterministic kernel warn instead of raising.
        enabled: False: a no-op.

    Raises:
        TypeError, ValueError: a bad argument (nothing is changed then); used as a decorator.
        SpeedupsError: :func:`~speedups.fast_kernels` in force; ``with`` on a switch already restored;
            ``restore()`` while a newer ``deterministic`` is in force.

    Example:
        >>> with deterministic(seed=0) as switch:
        ...     a = torch.randn(3)
        >>> with deterministic(seed=0):
        ...     torch.equal(a, torch.randn(3)), torch.are_deterministic_algorithms_enabled()
        (True, True)
        >>> torch.are_deterministic_algorithms_enabled(), switch.active
        (False, False)
    """

    def __init__(
        self, seed: int | None, *, per_rank: bool = False, warn_only: bool = False, enabled: bool = True
    ) -> None:
        said = f"deterministic(seed={seed!r}, per_rank={per_rank!r}, warn_only={warn_only!r}"
        said += f", enabled={enabled!r})"
        self._said = said
        self._where = user_line()  # names this switch in messages beside others made alike
        if callable(seed) and not isinstance(seed, int):
            name = getattr(seed, "__qualname__", validate.short(seed))
            raise TypeError(
                f"@deterministic on {name}: deterministic is a switch, not a decorator, and takes a seed; "
                f"nothing was changed. Write it inside the function: with deterministic(seed=0): ..."
            )
        rank = env.rank()
        with validate.arguments(said):
            validate.flag(enabled, "enabled")
            validate.flag(per_rank, "per_rank")
            validate.flag(warn_only, "warn_only")
            validate.integer(seed, "seed", minimum=0, maximum=_MAX_SEED, none_ok=True, example="0")
            if per_rank and seed is None:
                raise ValueError("per_rank=True adds the rank to a seed, and seed is None. Pass seed=0.")
            if per_rank and seed is not None and seed + rank > _MAX_SEED:
                raise ValueError(
                    f"seed + rank = {seed + rank} on rank {rank} is above 2**32 - 1 (NumPy's range). "
                    f"Pass a smaller seed, e.g. seed=0."
                )
        self.enabled, self.warn_only, self._seed = enabled, warn_only, seed
        self.seed: int | None = None if seed is None else seed + (rank if per_rank else 0)
        """The seed this process was seeded with (``seed + rank`` with ``per_rank=True``), or None."""
        self.changed: dict[str, tuple[Any, Any]] = {}
        """What the call set: name -> (value before, value set)."""
        self.limits: list[str] = []
        """What it cannot make deterministic here, in words."""
        self._saved: dict[str, Any] | None = None
        if enabled:
            opposite = kernel_switches.find("fast_kernels")
            if opposite is not None:
                raise SpeedupsError(
                    f"{said}: the {type(opposite).__name__}(...) made at {kernel_switches.made_at(opposite)} "
                    f"is in force, and a reproducible run needs the opposite (cuDNN autotuning off, no "
                    f"TF32). Restore it first: switch.restore() (or leave its with block), then "
                    f"deterministic(seed={seed!r})."
                )
            self._apply()

    @property
    def active(self) -> bool:
        """Whether the settings are in force (called with ``enabled=True`` and not yet restored)."""
        return self._saved is not None

    def _apply(self) -> None:
        cudnn = torch.backends.cudnn
        saved: dict[str, Any] = {
            "cudnn.deterministic": bool(cudnn.deterministic),
            "cudnn.benchmark": bool(cudnn.benchmark),
            "deterministic_algorithms": (
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            CUBLAS_CONFIG: os.environ.get(CUBLAS_CONFIG),
            "rng": get_rng_states(),
        }
        cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
        cudnn.deterministic, cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=self.warn_only)
        before = saved[CUBLAS_CONFIG]
        if before not in _DETERMINISTIC_CUBLAS:
            os.environ[CUBLAS_CONFIG] = ":4096:8"
        self._saved = saved
        kernel_switches.enter("deterministic", self, self._said, self._where)
        self.changed = {
            "torch.backends.cudnn.deterministic": (saved["cudnn.deterministic"], True),
            "torch.backends.cudnn.benchmark": (saved["cudnn.benchmark"], False),
            "torch.use_deterministic_algorithms": (saved["deterministic_algorithms"], (True, self.warn_only)),
            CUBLAS_CONFIG: (before, os.environ[CUBLAS_CONFIG]),
        }
        if self.seed is not None:
            seed_everything(self.seed)
            self.changed["seed"] = (None, self.seed)
        self.limits = [
            "ops without a deterministic kernel "
            + ("warn when called" if self.warn_only else "raise RuntimeError when called"),
            f"float results depend on the number of compute threads (now {torch.get_num_threads()}), "
            f"processes and loader workers, the torch version and the hardware: keep them the same",
        ]
        if cuda_started and before not in _DETERMINISTIC_CUBLAS:
            late = (
                f"cuBLAS: CUDA was initialised before {CUBLAS_CONFIG} was set, so cuBLAS may already have "
                f"chosen its workspace and stay nondeterministic in this process"
            )
            self.limits.insert(0, late)
            warnings.warn(
                f"deterministic(seed={self.seed!r}): {late}. Call deterministic() before any CUDA work, "
                f"or start the process with `{CUBLAS_CONFIG}=:4096:8 python train.py`.",
                SpeedupsWarning,
                stacklevel=3,
            )

    def restore(self) -> None:
        """Put back what the call changed: the flags, ``CUBLAS_WORKSPACE_CONFIG`` and the random states.

        A second call (or one after ``enabled=False``) does nothing.

        Raises:
            SpeedupsError: a ``deterministic`` switch made after this one is still in force (restore newest
                first); nothing is changed then.
        """
        if self._saved is None:
            return
        kernel_switches.check_order(self, self._said)
        saved, self._saved = self._saved, None
        kernel_switches.leave(self)
        cudnn = torch.backends.cudnn
        cudnn.deterministic, cudnn.benchmark = saved["cudnn.deterministic"], saved["cudnn.benchmark"]
        algorithms, warn_only = saved["deterministic_algorithms"]
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        if saved[CUBLAS_CONFIG] is None:
            os.environ.pop(CUBLAS_CONFIG, None)
        else:
            os.environ[CUBLAS_CONFIG] = saved[CUBLAS_CONFIG]
        set_rng_states(saved["rng"])

    def __enter__(self) -> deterministic:
        if self.enabled and self._saved is None:
            raise SpeedupsError(
                f"with deterministic(seed={self.seed!r}): this switch was already restored, and a switch "
                f"takes effect when it is made. Make a new one: with deterministic(seed=0): ..."
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        """Refuse use as a decorator (``@deterministic(seed=0)``), once what the call changed is put back.

        A decorator could not undo what the switch did when the decorator line made it, and a fresh switch
        per call would seed every call alike (the same dropout masks at every step) and rewind the random
        streams after it.

        Raises:
            TypeError: always, saying how to write it.
        """
        raise kernel_switches.not_a_decorator(
            self, self._said, args[0] if args else None, self.restore,
            f"with deterministic(seed={self._seed!r}): ...",
        )  # fmt: skip

    def __repr__(self) -> str:
        state = "active" if self.active else "off" if not self.enabled else "restored"
        lines = [f"deterministic(seed={self.seed!r}, warn_only={self.warn_only!r}): {state}"]
        lines += [f"  set {name}: {old!r} -> {new!r}" for name, (old, new) in self.changed.items()]
        lines += [f"  not deterministic: {limit}" for limit in self.limits]
        return "\n".join(lines)

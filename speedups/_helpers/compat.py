"""The one place that touches torch's private APIs; each use is tested (see tests/test_sharding.py)."""

from __future__ import annotations

import functools
import inspect
import operator
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "uncompile_module",
    "has_compiled_call",
    "NOT_COMPILING",
    "checkpoint_region",
    "eager_frames",
    "outside_compile",
    "leave_to_eager",
    "eager_below",
    "graph_break_at",
    "restore_frames",
    "compiled_inner",
    "grad_version",
    "default_store",
    "register_load_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "keeps_live_iterator",
    "live_loader_iterator",
    "set_worker_seed",
    "worker_numpy_seed",
    "restarts_loader_workers",
    "loader_iterator_resetting",
    "restart_loader_workers",
]


def register_state_dict_post_hook(
    module: nn.Module, hook: Callable[[nn.Module, dict[str, Any], str, dict[str, Any]], None]
) -> RemovableHandle:
    """Register ``hook(module, state_dict, prefix, local_metadata)`` to edit ``state_dict`` in place.

    Public as ``nn.Module.register_state_dict_post_hook`` since torch 2.5; torch 2.4 has only the private
    ``_register_state_dict_hook``, whose in-place behaviour is the same when the hook returns None.
    """
    public = getattr(module, "register_state_dict_post_hook", None)
    if public is not None:
        return public(hook)
    return module._register_state_dict_hook(hook)


def register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    """Register ``hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors)``.

    Public as ``nn.Module.register_load_state_dict_pre_hook`` since torch 2.5; torch 2.4 has the private
    ``_register_load_state_dict_pre_hook(hook, with_module=True)`` with the same signature.
    """
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)


def compiled_inner(module: object) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, or None if ``module`` is not one.

    ``OptimizedModule`` lives in the private ``torch._dynamo.eval_frame``; nothing is imported here (that
    costs seconds): if that module was never imported, no compiled module can exist.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        inner = getattr(module, "_orig_mod", None)
        return inner if isinstance(inner, nn.Module) else None
    return None


def default_store() -> Any:
    """The key-value store of the default process group (``torch.distributed.Store``), or None.

    Only the private ``distributed_c10d._get_default_store`` gives it; the group keeps it for its whole life.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    get = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    try:
        return None if get is None else get()
    except (RuntimeError, ValueError):  # a group without a store (fake or custom backends)
        return None


grad_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""The version counter of a tensor: in-place changes (autograd accumulating into a gradient, ``zero_()``)
bump it. ``Tensor._version`` is the counter autograd itself checks; torch has no public spelling of it. An
``attrgetter``: read once or twice per micro-step, at C speed."""


def checkpoint_region(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    contexts: Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]],
) -> Generator[None, None, None]:
    """torch's non-reentrant activation checkpoint of one call ``fn(*args, **kwargs)``, as a generator.

    ``next()`` once before the call (the saved tensors hooks go on, the RNG state is stashed) and once after
    it (they come off): what torch's own ``checkpoint(fn, use_reentrant=False)`` and its composable,
    hook-based ``torch.distributed._composable.checkpoint`` run around the call, so the recompute (and the
    RNG it restores) is bit for bit theirs. ``contexts()`` gives the contexts of the forward and of the
    recompute (``context_fn``). torch has no public spelling: torch >= 2.10 names it
    ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, ...)``; earlier releases take the
    options positionally before ``*args`` (2.4: no ``early_stop``), read here from the signature.
    """
    from torch.utils import checkpoint as tuc

    impl = getattr(tuc, "_checkpoint_without_reentrant_generator_impl", None)
    if impl is not None:
        return impl(fn, args, kwargs, preserve_rng_state=True, context_fn=contexts)  # type: ignore[no-any-return,unused-ignore]
    legacy: Any = tuc._checkpoint_without_reentrant_generator
    options: dict[str, Any] = {"preserve_rng_state": True, "context_fn": contexts}
    options.update(determinism_check="default", debug=False, early_stop=True)
    leading = [options[name] for name in _leading_options(legacy)]
    return legacy(fn, *leading, *args, **kwargs)  # type: ignore[no-any-return,unused-ignore]


@functools.cache
def _leading_options(legacy: Callable[..., Any]) -> tuple[str, ...]:
    """The option names an older torch's checkpoint generator takes positionally after ``fn``."""
    params = inspect.signature(legacy).parameters.items()
    return tuple(name for name, p in params if p.kind is p.POSITIONAL_OR_KEYWORD and name != "fn")


NOT_COMPILING = object()
"""What :func:`eager_frames` returns when ``torch.compile`` cannot be running (dynamo never imported)."""


def eager_frames() -> Any:
    """Run the Python frames that follow eagerly, out of ``torch.compile``'s reach, until restored.

    A checkpointed block's forward must run as its recompute will (eagerly: torch runs the recompute with
    dynamo off); compiled apart, AOT autograd would save other tensors than the recompute makes and torch's
    checkpoint raises (pytorch/pytorch#166926). dynamo's frame callback is swapped with ``torch._C._dynamo
    .eval_frame.set_eval_frame`` (what ``torch.compiler.disable`` does around one call; there is no public
    spelling for a span between two hooks). Returns what :func:`restore_frames` puts back. Call it only from
    a function :func:`outside_compile` made.
    """
    if "torch._dynamo" not in sys.modules:
        return NOT_COMPILING  # nothing has been compiled in this process: no frame callback to swap
    frames: Any = torch._C._dynamo.eval_frame
    return frames.set_eval_frame(None)


def outside_compile(*methods: Callable[..., Any]) -> list[Callable[..., Any]]:
    """Module hooks that ``torch.compile`` never traces nor compiles: each runs as written, eagerly.

    Each bound method is wrapped with ``torch.compiler.disable(recursive=False)`` (dynamo then breaks the
    graph at the hook, silently, instead of tracing into it) and its code is skipped when called as a frame
    (:func:`leave_to_eager`): what a hook does to dynamo's frame callback (:func:`eager_frames`) lasts past
    it. Imports dynamo (about a second, once; torch's checkpoint imports it at its first call anyway).
    """
    import torch._dynamo  # loaded here: leave_to_eager needs it

    leave_to_eager(checkpoint_region, eager_frames, restore_frames)  # what the hooks call: frames too
    wrapped = []
    for method in methods:
        function = getattr(method, "__func__", method)
        leave_to_eager(function)

        def hook(*args: Any, _method: Callable[..., Any] = method) -> Any:
            return _method(*args)

        leave_to_eager(hook)
        wrapped.append(torch.compiler.disable(hook, recursive=False))
    return wrapped


def restore_frames(prior: Any) -> None:
    """Put back the frame callback :func:`eager_frames` swapped out."""
    if prior is not NOT_COMPILING:
        frames: Any = torch._C._dynamo.eval_frame
        frames.set_eval_frame(prior)


def leave_to_eager(*functions: Callable[..., Any]) -> None:
    """Have ``torch.compile`` never compile a frame of these functions (autograd hooks, module hooks: run
    from C++ or between compiled regions, each would be compiled as a frame of its own, and recompiled).

    dynamo's ``skip_code`` (``torch._dynamo.eval_frame``; ``torch._C._dynamo.eval_frame`` in torch 2.4);
    ``torch.compiler.disable(fn, recursive=False)`` marks a wrapper's code the same way. A no-op while
    dynamo was never imported (nothing can be compiled then).
    """
    if "torch._dynamo" not in sys.modules:
        return
    frames: Any = torch._C._dynamo.eval_frame
    skip = getattr(sys.modules["torch._dynamo.eval_frame"], "skip_code", None) or frames.skip_code
    for fn in functions:
        skip(fn.__code__)


def keeps_live_iterator(loader: Any) -> bool:
    """Whether ``loader`` (a ``DataLoader``) keeps its persistent workers' iterator where
    :func:`live_loader_iterator` reads it."""
    return "_iterator" in vars(loader)


def live_loader_iterator(loader: Any) -> Any:
    """The iterator a ``DataLoader`` with persistent workers keeps across passes, or None before its first.

    ``DataLoader._iterator``: torch builds it at the first ``iter(loader)`` (assigned once built, so it is
    still None while the first pass starts) and resets it at the next ones; no public spelling.
    """
    return loader._iterator


def worker_numpy_seed(base_seed: int, worker_id: int) -> Any:
    """What torch's loader worker seeds numpy's global ``RandomState`` with (a list of 4 uint32 words).

    torch's private ``torch.utils.data._utils.worker._generate_state(base_seed, worker_id)``, the function
    its ``_worker_loop`` calls; no public spelling.
    """
    from torch.utils.data._utils import worker

    return worker._generate_state(base_seed, worker_id)


def set_worker_seed(info: Any, seed: int) -> None:
    """Make ``torch.utils.data.get_worker_info().seed`` report ``seed`` in this worker.

    ``WorkerInfo`` refuses assignment (a frozen dataclass in recent torch, a class whose ``__setattr__``
    raises once initialised before): ``object.__setattr__`` sets the field in both.
    """
    object.__setattr__(info, "seed", seed)


def eager_below(*functions: Callable[..., Any]) -> bool:
    """Have ``torch.compile`` run these functions' frames, and every frame they call, as they are: never
    traced nor compiled, what ``torch.compiler.disable(fn)`` does around one call, at no cost when nothing is
    being compiled (dynamo's per-code frame strategy ``(SKIP, SKIP)``, ``torch._C._dynamo.eval_frame``; no
    public spelling). Needs no import of ``torch._dynamo``. Returns False where this torch has no such
    strategy (before about 2.6): the caller then checks ``torch.compiler.is_compiling()`` itself.
    """
    frames: Any = torch._C._dynamo.eval_frame
    strategy = getattr(frames, "_FrameExecStrategy", None)
    action = getattr(frames, "_FrameAction", None)
    setter = getattr(frames, "set_code_exec_strategy", None)
    if strategy is None or action is None or setter is None:
        return False
    for fn in functions:
        setter(fn.__code__, strategy(action.SKIP, action.SKIP))
    return True


def graph_break_at(fn: Callable[..., Any], reason: str) -> None:
    """Have ``torch.compile`` break its graph at every call of ``fn`` and run it, and all it calls, eagerly,
    saying ``reason`` where a graph break is an error (``fullgraph=True``).

    What ``torch.compiler.disable(fn, reason=...)`` marks on the wrapper it returns (dynamo reads
    ``_torchdynamo_disable`` and ``_torchdynamo_disable_msg`` on a function it would inline; no public
    spelling), set on ``fn`` itself, so nothing imports ``torch._dynamo`` (a second, once) and no wrapper
    costs a call; its frames run eagerly by :func:`eager_below`.
    """
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    eager_below(fn)


def uncompile_module(module: nn.Module) -> None:
    """Undo ``module.compile()``: its calls run the eager ``_call_impl`` again.

    ``nn.Module.compile`` stores ``torch.compile(self._call_impl)`` as ``_compiled_call_impl``, which
    ``__call__`` prefers; torch has no public undo, so the attribute goes back to its class default (None).
    """
    module.__dict__.pop("_compiled_call_impl", None)


def has_compiled_call(module: nn.Module) -> bool:
    """Whether ``module``'s own call is compiled (``module.compile()``, which ``compile_blocks`` uses).

    ``nn.Module.compile`` stores ``torch.compile(self._call_impl)`` as the instance attribute
    ``_compiled_call_impl``, which ``__call__`` prefers; torch has no public reader. A call compiled so runs
    compiled wherever it is made, also under ``torch._disable_dynamo`` (torch's checkpoint recompute): its
    ``torch.compile`` wrapper turns dynamo back on.
    """
    return module.__dict__.get("_compiled_call_impl") is not None


@functools.cache
def restarts_loader_workers() -> bool:
    """Whether this torch lets :func:`restart_loader_workers` swap a persistent loader's iterator mid-reset.

    ``DataLoader.__iter__`` with persistent workers calls ``self._iterator._reset(self)`` and then returns
    ``self._iterator``, read again: an iterator put there during the reset is the one the loop gets (so in
    torch 2.4 to 2.14). Read from its source (else its names); ``_get_iterator`` and the multi-process
    iterator's ``_shutdown_workers`` must exist too. False: persistent workers cannot be restarted for one
    epoch (tests/data/test_changing_datasets.py checks it is True here).
    """
    from torch.utils.data import DataLoader, dataloader

    multi = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if not callable(getattr(DataLoader, "_get_iterator", None)) or not callable(
        getattr(multi, "_shutdown_workers", None)
    ):
        return False
    try:
        source = inspect.getsource(DataLoader.__iter__)
    except (OSError, TypeError):  # no source shipped: its names at least
        names = DataLoader.__iter__.__code__.co_names
        return {"_iterator", "_reset", "_get_iterator"} <= set(names)
    return "._reset(self)" in source and "return self._iterator" in source


def loader_iterator_resetting(loader: Any) -> bool:
    """Whether ``loader``'s persistent iterator is inside torch's ``_reset`` for a new pass: it has sent no
    index of the pass yet (``_send_idx``, which ``_reset`` sets to 0), as opposed to a sampler iterated by
    hand between passes."""
    return getattr(loader._iterator, "_send_idx", 0) == 0


def restart_loader_workers(loader: Any) -> None:
    """Stop ``loader``'s persistent workers and give it a fresh iterator: new workers copying the dataset as
    it is now, and the base-seed draw a fresh ``DataLoader`` iterator makes (``DataLoader._get_iterator``).

    Call it only from the sampler's first index of a pass, inside the live iterator's ``_reset`` (after
    its workers acknowledged the new pass, before any index is sent), when
    :func:`restarts_loader_workers`: the reset then finds no index and the loop gets the new iterator. The
    old workers are shut down first (``_shutdown_workers``); if the new ones fail to start, the loader keeps
    none, so its next ``iter()`` starts fresh ones.
    """
    old = loader._iterator
    old._shutdown_workers()
    loader._iterator = None
    loader._iterator = loader._get_iterator()

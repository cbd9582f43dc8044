"""Tip 1: a DataLoader with fast defaults, sheltered workers, and a pickling check before any worker starts.

``fast_loader(dataset, batch_size)`` returns a plain :class:`torch.utils.data.DataLoader` with worker
processes sized to the CPUs this process may use, pinned memory only where CUDA is used, and workers that
outlive a stop signal until the main process has saved. What it yields, and every number it draws from the
main process's random streams, epoch after epoch, are those of ``DataLoader`` with the same arguments:
torch seeds each worker's torch, ``random`` and numpy streams from the epoch's base seed; the workers start
once and are reseeded from it every epoch as fresh ones would be (:mod:`speedups.data.persistence`).

Under the ``spawn`` and ``forkserver`` start methods (the default on macOS, Windows and Python 3.14) what a
worker needs is test-pickled first, so a lambda ``collate_fn`` fails early with a message that names it,
instead of a ``PicklingError`` in the middle of an epoch (:mod:`speedups.data.workers`).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from speedups._helpers import env, validate
from speedups._helpers.hardware import cpus_per_process
from speedups._helpers.validate import short
from speedups.data.persistence import EXACT, build_loader, unwrapped
from speedups.data.rank_stream import splits_itself
from speedups.data.sample_keys import SampleKeys
from speedups.data.seeded_samples import SeededSamples, refuse_stream
from speedups.data.workers import (
    check_worker_init_fn,
    dataloader_parameters,
    release_workers_at_exit,
    seed_worker,
    start_method,
    unpicklable_for_workers,
)
from speedups.errors import SpeedupsError, SpeedupsWarning

__all__ = ["fast_loader"]


def _default_prefetch(num_workers: int) -> int:
    """Batches each worker loads ahead: at least 2 (torch's default), and at least 4 in flight in total."""
    return max(2, math.ceil(4 / num_workers))


# ------------------------------------------------------------------------------------------ fast_loader
def fast_loader(
    dataset: Any,
    batch_size: int | None = 1,
    *,
    shuffle: bool = False,
    num_workers: int | str = "auto",
    seed: int | None = None,
    sample_seeds: bool = False,
    **dataloader_kwargs: Any,
) -> DataLoader[Any]:
    """Build a plain ``torch.utils.data.DataLoader`` with defaults that keep the training step fed.

    Against ``DataLoader(dataset, batch_size, shuffle=shuffle)``: ``num_workers="auto"`` gives one worker per
    CPU this process may use, shared among the node's processes (``LOCAL_WORLD_SIZE``), or 0 for an
    ``IterableDataset`` (one :class:`~speedups.SpeedupsWarning`, as for a stream read by several ranks or
    workers: each would replay it; ``distributed()`` splits it, or the dataset declares
    ``splits_by_rank = True``); with workers, a ``prefetch_factor`` that keeps 4 batches in flight and a
    ``worker_init_fn`` that shelters them from stop signals, then calls yours; ``pin_memory`` only with
    CUDA. Any other keyword goes to ``DataLoader`` and wins. It does not help a ``TensorDataset`` already in
    memory: measure with :func:`~speedups.tune_loader`.

    What it yields and what it draws from the main process's RNG (or ``generator``), epoch after epoch, are
    those of ``DataLoader(..., persistent_workers=False)`` with the same arguments, bit for bit, yet workers
    start once: each epoch draws the workers' base seed where a fresh iterator draws it (torch's persistent
    workers draw it once, which shifts every later draw: the next shuffle, the loop's own noise), and each
    worker, at the epoch's first item, reseeds its torch, ``random`` and numpy streams from it, sets
    ``get_worker_info().seed`` and runs ``worker_init_fn`` again, as a fresh worker would (what a worker
    keeps in its own globals lives on). Fresh workers copy the dataset each epoch; live ones keep theirs, so
    an epoch whose dataset, ``collate_fn`` or ``worker_init_fn`` changed in the main process (an attribute
    reassigned, a tensor, array, list or dict changed in place, a generator advanced, also in a wrapped
    dataset or one level down) starts fresh workers, and once the workers change their own copy
    (``worker_init_fn`` adjusting it, a generator the dataset owns) every later epoch does: one
    :class:`~speedups.SpeedupsWarning`; what is not seen: docs/tips/fast-loader.md. ``loader.dataset`` and
    ``loader.sampler`` wrap yours and read through (``.dataset``, ``.sampler``). Fresh workers each epoch
    where that cannot be matched: an ``IterableDataset`` (no index carries the seed), a dataset with
    ``set_epoch`` or wrapping one. ``persistent_workers=True``/``False`` gives torch's own.

    ``sample_seeds=True`` seeds torch's CPU RNG, ``random`` and numpy per sample from (seed, epoch, index),
    so random augmentation gives the same batches for any workers, world size or resume; the order becomes
    ``DistributedSampler``'s (``seed + epoch``). About 10 us per item (when: docs/tips/fast-loader.md).

    Args:
        dataset: a map-style or iterable-style dataset.
        batch_size: samples per batch (an int >= 1), or None to disable automatic batching.
        shuffle: reshuffle the sample order every epoch.
        num_workers: ``"auto"`` or a number of worker processes >= 0.
        seed: seed of a new ``torch.Generator`` for shuffling and the workers' seeds (not with
            ``generator=``); None uses the global torch RNG.
        sample_seeds: per-sample random streams (int indices); seeded from ``seed`` (an int in [0, 2**63)),
            else ``generator.initial_seed()``, else ``torch.initial_seed()``.
        **dataloader_kwargs: any other ``DataLoader`` argument (``collate_fn``, ``sampler``, ...).

    Returns:
        A plain ``DataLoader``; its ``worker_init_fn`` is picklable. With workers that persist, the loader
        itself cannot be pickled (its sampler holds it weakly), as none with live workers can.

    Raises:
        TypeError: an argument of the wrong type (a ``DataLoader``, model, tensor or class as ``dataset``;
            an object neither indexable with a length nor an ``IterableDataset``), a ``worker_init_fn`` that
            cannot be called with the worker id, or an argument ``DataLoader`` does not take.
        ValueError: ``batch_size`` < 1, ``num_workers`` < 0, both ``seed`` and ``generator``, or
            ``sample_seeds=True`` for an ``IterableDataset``.
        SpeedupsError: workers would start with ``spawn``/``forkserver`` and the dataset, ``collate_fn``
            or ``worker_init_fn`` cannot be pickled (the message names it; checked before any worker starts).

    Example:
        >>> loader = fast_loader(list(range(10)), batch_size=4, num_workers=0, seed=0, shuffle=True)
        >>> [len(b) for b in loader]
        [4, 4, 2]
        >>> type(loader).__name__, loader.pin_memory == torch.cuda.is_available()
        ('DataLoader', True)

    Source: PyTorch's data loading notes ("Randomness in multi-process data loading").
    """
    _check_dataset(dataset, batch_size, dataloader_kwargs)
    user_init = dataloader_kwargs.get("worker_init_fn")
    said = f"fast_loader(batch_size={batch_size!r}, num_workers={num_workers!r}, seed={seed!r}"
    said += ", sample_seeds=True)" if sample_seeds is True else ")"
    with validate.arguments(said):
        validate.integer(batch_size, "batch_size", minimum=1, none_ok=True, example="64 (None: no batching)")
        if num_workers != "auto":
            fix = "'auto' (one per CPU) or num_workers=0 (the main process loads)"
            validate.integer(num_workers, "num_workers", minimum=0, example=fix)
        validate.flag(shuffle, "shuffle")
        validate.flag(sample_seeds, "sample_seeds")
        # What torch.Generator.manual_seed takes; with sample_seeds, room for seed + epoch.
        low, high = (0, 2**63 - 1) if sample_seeds else (-(2**63), 2**64 - 1)
        validate.integer(seed, "seed", minimum=low, maximum=high, none_ok=True, example="0")
        if sample_seeds:
            _check_sample_seeds(dataset, dataloader_kwargs)
        if seed is not None and dataloader_kwargs.get("generator") is not None:
            raise ValueError(
                "both seed and generator were given; they choose the same thing. Pass one: "
                "seed=0, or generator=torch.Generator().manual_seed(0)."
            )
        unknown = sorted(set(dataloader_kwargs) - dataloader_parameters())
        if unknown:
            allowed = sorted(dataloader_parameters() - {"self", "num_workers", "shuffle", "batch_size"})
            raise TypeError(f"unknown DataLoader argument(s) {unknown}. Allowed: {allowed}.")
        check_worker_init_fn(user_init)  # torch calls it only in a worker, at the first batch

    kwargs = dict(dataloader_kwargs)
    dataset = unwrapped(dataset)  # another loader's dataset: the user's own, seeded again if asked
    if isinstance(dataset, SeededSamples):
        dataset = dataset.dataset
    stream = isinstance(dataset, IterableDataset) and not splits_itself(dataset)  # replayed per reader
    if num_workers == "auto":
        workers = 0 if stream else cpus_per_process()  # may be 0: fewer CPUs than local processes
        if workers == 0:  # settings that only mean something with workers: "auto" did not apply
            for key in ("persistent_workers", "prefetch_factor", "multiprocessing_context"):
                kwargs.pop(key, None)
    else:
        workers = int(num_workers)
    if stream:
        _warn_replayed(dataset, batch_size, num_workers, workers)

    kwargs["worker_init_fn"] = (
        seed_worker if user_init is None else functools.partial(seed_worker, init_fn=user_init)
    )
    if workers > 0:
        release_workers_at_exit()  # its workers ignore SIGTERM: never let the exit wait for them
        # torch's persistent workers draw their base seed once, where DataLoader's restarted workers draw it
        # every epoch: every later draw of the main process (the next shuffle, the loop's own) would shift.
        # EXACT keeps the workers and draws it every epoch (build_loader; fresh workers where it cannot), also
        # with per-sample seeds: a worker's own streams (randomness in collate_fn), its get_worker_info().seed
        # and worker_init_fn still follow the base seed there.
        kwargs.setdefault("persistent_workers", EXACT)
        kwargs.setdefault("prefetch_factor", _default_prefetch(workers))
        method = start_method(kwargs.get("multiprocessing_context"))
        bad = unpicklable_for_workers(method, dataset, kwargs.get("collate_fn"), user_init)
        if bad is not None:
            name, obj, err = bad
            raise SpeedupsError(
                f"fast_loader({name}={short(obj)}, num_workers={num_workers!r}): workers start "
                f"with {method!r}, which pickles the {name} for each worker, and it cannot be pickled "
                f"({type(err).__name__}: {err}). Define it at module level (no lambda, local function "
                f"or local class), or load in the main process: num_workers=0."
            )
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    if sample_seeds:
        dataset, shuffle = _with_sample_seeds(dataset, shuffle, seed, kwargs)
    if not isinstance(dataset, IterableDataset) or shuffle:
        kwargs["shuffle"] = shuffle
    return build_loader(DataLoader, dataset, batch_size=batch_size, num_workers=workers, **kwargs)


def _check_dataset(dataset: Any, batch_size: int | None, kwargs: dict[str, Any]) -> None:
    """Refuse what ``DataLoader`` would only fail on at the first batch (in ``default_collate``, a worker).

    Raises:
        TypeError: a ``DataLoader``, a class, a model, a tensor, a string, or an object that is neither an
            ``IterableDataset`` nor indexable (``__getitem__``, and ``__len__`` unless a sampler is given).
    """
    size = 64 if batch_size is None else batch_size
    if isinstance(dataset, DataLoader):
        raise TypeError(
            f"fast_loader(dataset=DataLoader(...)): dataset is already a DataLoader; fast_loader builds the "
            f"DataLoader from a dataset. Pass its dataset: fast_loader(loader.dataset, "
            f"{dataset.batch_size if batch_size is None else batch_size}, shuffle=True)."
        )
    if isinstance(dataset, type):
        raise TypeError(
            f"fast_loader(dataset={dataset.__qualname__}, {batch_size!r}): dataset is a class, not a "
            f"dataset. Pass an instance: fast_loader({dataset.__qualname__}(...), {size})."
        )
    if isinstance(dataset, torch.nn.Module) and not isinstance(dataset, Dataset):
        raise TypeError(
            f"fast_loader(dataset={type(dataset).__name__}(...), {batch_size!r}): dataset is a model (an "
            f"nn.Module), not a dataset; fast_loader takes the samples and the model goes to the step. Pass "
            f"the data: fast_loader(TensorDataset(x, y), {size}), or your Dataset."
        )
    if isinstance(dataset, torch.Tensor):
        shape = tuple(dataset.shape)
        raise TypeError(
            f"fast_loader(dataset=tensor of shape {shape}, {batch_size!r}): a bare tensor is not a dataset "
            f"of (input, target) samples; each row would be one sample with no target. Wrap the tensors: "
            f"fast_loader(TensorDataset(x, y), {size}) (or TensorDataset(x) for inputs alone)."
        )
    if _columns(dataset):
        shapes = ", ".join(str(tuple(t.shape)) for t in dataset)
        raise TypeError(
            f"fast_loader(dataset=a tuple of tensors of shapes {shapes}, {batch_size!r}): the tuple would be "
            f"a dataset of {len(dataset)} samples, one per tensor, where you meant one sample per row. Wrap "
            f"the tensors: fast_loader(TensorDataset(*tensors), {size}), e.g. TensorDataset(x, y)."
        )
    if isinstance(dataset, IterableDataset):
        return
    ordered = kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None
    if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__getitem__"):
        streamed = hasattr(dataset, "__iter__") and not isinstance(dataset, (str, bytes))
        also = (
            " A plain iterable (a generator, a file) is indexed by DataLoader, not iterated: make it an "
            "IterableDataset (class Stream(IterableDataset) with __iter__) or a list."
            if streamed
            else ""
        )
        raise TypeError(
            f"fast_loader(dataset={short(dataset)}, {batch_size!r}): expected a map-style dataset (with "
            f"__getitem__ and __len__) or an IterableDataset, got {type(dataset).__name__}.{also} E.g. "
            f"fast_loader(TensorDataset(x, y), {size})."
        )
    if not ordered and not callable(getattr(dataset, "__len__", None)):
        raise TypeError(
            f"fast_loader(dataset={short(dataset)}, {batch_size!r}): {type(dataset).__name__} has "
            f"__getitem__ but no __len__, and DataLoader's sampler needs the number of samples. Give the "
            f"dataset a __len__, or pass your own sampler=."
        )


def _columns(dataset: Any) -> bool:
    """Whether ``dataset`` is a tuple of tensors holding rows, ``(x, y)``: every one with the same first
    dimension, longer than the tuple, one of them a matrix at least (a tuple of a few vectors, samples of
    one shape, is left alone)."""
    if not isinstance(dataset, tuple) or len(dataset) < 2:
        return False
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in dataset):
        return False
    if all(t.dim() == 1 for t in dataset):
        return False
    rows = {int(t.shape[0]) for t in dataset}
    return len(rows) == 1 and rows.pop() > len(dataset)


def _check_sample_seeds(dataset: Any, kwargs: dict[str, Any]) -> None:
    """Raise what ``sample_seeds=True`` cannot serve: a stream, or no ``__len__`` to order."""
    refuse_stream(dataset, "or pass sample_seeds=False")
    ordered = kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None
    if not ordered and not callable(getattr(dataset, "__len__", None)):
        raise TypeError(
            f"sample_seeds=True orders the samples of an epoch, and {type(dataset).__name__} has no "
            f"__len__. Give the dataset a __len__, or pass your own sampler=."
        )


def _with_sample_seeds(
    dataset: Any, shuffle: bool, seed: int | None, kwargs: dict[str, Any]
) -> tuple[SeededSamples, bool]:
    """The dataset seeded per sample and, in ``kwargs``, a sampler handing out ``(index, epoch)`` keys.

    The user's sampler or batch sampler is wrapped (its own ``epoch`` followed when it has one, as a
    ``DistributedSampler`` does); without one, a one-rank ``DistributedSampler`` orders the epoch from
    ``seed + epoch``, so the order, like the augmentation, never depends on the workers' base-seed draws.
    """
    generator = kwargs.get("generator")
    if seed is None:  # may differ between ranks: distributed() then uses its own seed
        base = (generator or torch.default_generator).initial_seed() % 2**63  # room for seed + epoch
        seeded = SeededSamples(dataset, base, samples_seed_given=False)
    else:
        base = seed
        seeded = SeededSamples(dataset, seed)
    if generator is None:  # the workers' base seed drawn from its own generator, never the global RNG:
        kwargs["generator"] = torch.Generator().manual_seed(base)  # loading leaves it alone in any layout
    if kwargs.get("batch_sampler") is not None:
        inner = kwargs["batch_sampler"]
        kwargs["batch_sampler"] = SampleKeys(inner, batched=True, drive=not _has_epoch(inner))
    elif kwargs.get("sampler") is not None:
        inner = kwargs["sampler"]
        kwargs["sampler"] = SampleKeys(inner, drive=not _has_epoch(inner))
    else:
        kwargs["sampler"] = SampleKeys.seeded_order(seeded, shuffle=shuffle, seed=base)
        shuffle = False  # the sampler shuffles
    return seeded, shuffle


def _has_epoch(sampler: object) -> bool:
    """Whether a sampler keeps its own epoch (a ``DistributedSampler``: its ``set_epoch`` is the caller's)."""
    epoch = getattr(sampler, "epoch", None)
    return isinstance(epoch, int) and not isinstance(epoch, bool)


def _warn_replayed(dataset: object, batch_size: int | None, asked: int | str, workers: int) -> None:
    """One warning (rank 0) when a stream would be read whole by every rank or worker."""
    ranks = env.world_size()
    if ranks == 1 and workers <= 1 and asked != "auto":
        return
    readers = []
    if ranks > 1:
        readers.append(f"each of the {ranks} ranks")
    if workers > 1:
        readers.append(f"each of the {workers} workers")
    said = f"fast_loader({type(dataset).__name__}(), num_workers={asked!r})"
    if readers:
        what = f"{' and '.join(readers)} would read the whole stream: every sample trained on more than once"
    else:
        what = "an IterableDataset gets 0 workers, since every worker would read the whole stream"
    if env.rank() == 0:
        warnings.warn(
            f"{said}: {what}. Split it by rank and worker: distributed(DataLoader(dataset, "
            f"batch_size={batch_size}, num_workers=2)), or split it inside the dataset (get_worker_info(), "
            f"speedups.rank()) and declare that with a class attribute `splits_by_rank = True`.",
            SpeedupsWarning,
            stacklevel=3,
        )

"""Tip 9, the data half: a DataLoader whose ``DistributedSampler`` advances its epoch by itself.

:func:`distributed` rebuilds a ``DataLoader`` around a sampler that gives each rank its share of every epoch,
never forgets ``set_epoch``, can leave the padding out for evaluation (``even=False``) and resumes mid-epoch
from :meth:`DistributedLoader.state_dict`. In a plain process (world size 1) the order is the whole dataset.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from speedups._helpers import env, validate
from speedups._helpers.layout import LayoutChange
from speedups.data.persistence import build_loader, rebuilt_persistence, reseeds_workers, unwrapped
from speedups.data.rank_sampler import RankSampler
from speedups.data.rank_stream import RankStream, splits_itself
from speedups.data.sample_keys import SampleKeys
from speedups.data.sampler_adoption import adopted, check_adoptable
from speedups.data.seeded_samples import SeededSamples, refuse_stream
from speedups.data.workers import check_worker_init_fn, sheltered
from speedups.errors import SpeedupsError

__all__ = ["DistributedLoader", "distributed"]


class DistributedLoader(DataLoader):
    """A ``DataLoader`` whose ``DistributedSampler`` advances its epoch by itself and can resume mid-epoch.

    Made by :func:`distributed`; it *is* a ``DataLoader`` (``isinstance``, ``len``, ``iter``, every
    attribute), built from the original's settings. Each ``iter()`` starts the next epoch (0, 1, 2, ...) and
    calls ``sampler.set_epoch`` for you. :attr:`epoch` is the epoch of the current (or last) pass.
    ``set_epoch(k)`` makes the next pass epoch k. :meth:`state_dict` holds the epoch and the number of
    batches already handed out in it, so :func:`~speedups.load_checkpoint` resumes exactly after the last
    batch trained on: neither replayed nor skipped (the skipped batches are never loaded). During a resumed
    pass, ``len()`` is the number of batches that pass yields.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self._resume_batches = 0
        self._current: tuple[int, int] | None = None  # (epoch, batches handed out) of the pass in progress
        self._live: weakref.ref[_Counting] | None = None  # the iterator of the pass in progress
        # The state of the generator the workers' base seed was drawn from, taken just before the draw (a
        # pass's iterator draws once: from ``generator``, else the global torch RNG), and the one to draw
        # from instead after a restore: a resumed pass then draws nothing the uninterrupted run did not.
        self._seed_state: torch.Tensor | None = None
        self._replay_seed: torch.Tensor | None = None
        self._workers_started = False  # torch's own persistent workers: only the first iterator draws
        self.epoch = -1
        """Epoch of the current or last pass; -1 before the first."""

    @property
    def distributed_sampler(self) -> DistributedSampler:
        """The ``DistributedSampler`` (also when it sits inside the loader's ``batch_sampler``)."""
        batch_sampler = unwrapped(self.batch_sampler)
        sampler = unwrapped(self.sampler if batch_sampler is None else batch_sampler.sampler)
        if isinstance(sampler, SampleKeys):  # sample_seeds=True: the keys follow this sampler's epoch
            sampler = sampler.sampler
        return sampler

    def _batch_size(self) -> int:
        if self.batch_sampler is None:
            return 1
        return int(self.batch_sampler.batch_size)  # type: ignore[attr-defined]

    def _start_at(self, batches: int) -> None:
        """Make the sampler's next pass skip the samples of the first ``batches`` batches of its epoch.

        Raises:
            SpeedupsError: a mid-epoch position, and a sampler that cannot start mid-epoch (a loader made
                as ``DistributedLoader(..., sampler=DistributedSampler(...))``, not by ``distributed()``).
        """
        sampler = self.distributed_sampler
        if isinstance(sampler, RankSampler):
            sampler.start_at(batches * self._batch_size())
        elif batches:
            raise SpeedupsError(
                f"DistributedLoader: resuming {batches} batches into an epoch needs the sampler "
                f"distributed() builds, but this loader's sampler is a {type(sampler).__name__}, which "
                f"always starts an epoch at its beginning. Build the loader with "
                f"speedups.distributed(DataLoader(...))."
            )

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its start (each later one then advances by 1)."""
        with validate.arguments(f"DistributedLoader.set_epoch(epoch={epoch!r})"):
            validate.integer(epoch, "epoch", minimum=0, example="0")
        self._next_epoch = epoch
        self._resume_batches = 0
        self._start_at(0)

    def __iter__(self) -> _Counting:  # type: ignore[override]
        sampler = self.distributed_sampler
        epoch, skip = self._next_epoch, self._resume_batches
        sampler.set_epoch(epoch)
        self._start_at(skip)
        self._next_epoch, self._resume_batches = epoch + 1, 0
        self.epoch = epoch
        self._current = (epoch, skip)
        counting = _Counting(self, self._inner_iterator(), epoch, skip)
        self._live = weakref.ref(counting)
        return counting

    def _inner_iterator(self) -> Iterator[Any]:
        """The DataLoader's iterator; its one base-seed draw replays a restored one instead of a new draw.

        Every pass draws one (fresh workers; workers that persist exactly draw it inside ``iter()`` too),
        except the later passes of torch's own persistent workers.
        """
        replay, self._replay_seed = self._replay_seed, None
        persistent = bool(self.persistent_workers and self.num_workers > 0) and not reseeds_workers(self)
        if persistent and self._workers_started:
            return super().__iter__()  # torch's persistent workers: no new base seed
        source = self.generator if self.generator is not None else torch.default_generator
        if replay is None:
            self._seed_state = source.get_state()
            inner = super().__iter__()
        else:  # resumed: the draw the uninterrupted run made before the checkpoint, made again from its state
            self._seed_state = replay
            now = source.get_state()
            source.set_state(replay)
            try:
                inner = super().__iter__()
            finally:
                source.set_state(now)
        self._workers_started = persistent
        return inner

    def state_dict(self) -> dict[str, Any]:
        """Return where the next batch comes from, and what the next pass must draw. No sync.

        Keys: ``epoch`` and ``batches`` (the position), ``world_size`` and ``rank``, ``seed_state`` (the RNG
        state the running pass drew its workers' base seed from, so a resumed pass draws the same seed
        without touching the global RNG; None at an epoch boundary, where the next pass draws afresh as an
        uninterrupted run does), ``generator`` (the state of the loader's ``generator``, or None), and the
        layout a resume on another number of processes needs: ``batch_size``, ``rank_samples`` (this rank's
        samples per epoch, padding included), ``drop_last``, ``samples`` (the dataset's length) and
        ``emulate`` (``[world, batch]`` of the layout whose micro-batches it deals after such a resume, or
        None: see ``RankSampler.emulate``).
        """
        epoch, batches = (
            self._current if self._current is not None else (self._next_epoch, self._resume_batches)
        )
        keep_seed = self._current is not None or self._workers_started or self._replay_seed is not None
        seed = self._replay_seed if self._replay_seed is not None else self._seed_state
        sampler = self.distributed_sampler
        emulated = sampler.emulated if isinstance(sampler, RankSampler) else None
        return {
            "epoch": epoch,
            "batches": batches,
            "world_size": sampler.num_replicas,
            "rank": sampler.rank,
            "seed_state": seed.clone() if keep_seed and seed is not None else None,
            "generator": None if self.generator is None else self.generator.get_state(),
            "batch_size": self._batch_size(),
            "rank_samples": int(sampler.num_samples),
            "drop_last": self._drop_last(),
            "samples": len(self.dataset),  # type: ignore[arg-type]
            "emulate": list(emulated) if emulated else None,
        }

    def _drop_last(self) -> bool:
        return self.batch_sampler is not None and bool(getattr(self.batch_sampler, "drop_last", False))

    def _merge_rank_states(self, states: list[Any], change: LayoutChange) -> dict[str, Any]:
        """This rank's state from what every rank saved on another layout: the same epoch, continued at
        ``change.batches`` (the same sample), with this loader's rank and layout (``load_checkpoint``)."""
        for state in states:
            self._check_state({**state, "batches": 0, "world_size": self.distributed_sampler.num_replicas})
        same = change.saved_world == change.world
        own = states[change.rank] if same and change.rank < len(states) else states[0]
        seeds = [state.get("seed_state") for state in states]
        seed = own.get("seed_state")
        if not same and not all(_same_generator_state(seed, other) for other in seeds):
            seed = None  # the ranks' workers drew from their own streams: the new layout draws afresh
        here = self.state_dict()
        # The micro-batches the saving layout made (or the one it emulated itself), kept on this layout, so a
        # model whose output depends on the whole micro-batch follows the run that never stopped.
        world, batch = own.get("emulate") or (change.saved_world, own.get("batch_size", here["batch_size"]))
        emulate = [world, batch] if batch == here["batch_size"] and world != change.world else None
        return {
            **here,
            "epoch": own["epoch"],
            "batches": own["batches"] if change.batches is None else change.batches,
            "seed_state": seed,
            "generator": own.get("generator"),
            "emulate": emulate,
        }

    def _check_state(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state``, changing nothing."""
        said = "DistributedLoader.load_state_dict(state)"
        required = {"epoch", "batches", "world_size", "rank"}
        optional = {"seed_state", "generator", "batch_size", "rank_samples", "drop_last", "samples"}
        optional.add("emulate")
        if not isinstance(state, dict) or not required <= set(state) <= required | optional:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{said}: expected keys {sorted(required | optional)}, got {got}. "
                f"Pass what DistributedLoader.state_dict() returned."
            )
        for key in ("epoch", "batches"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{said}: state[{key!r}]={value!r}, expected an int >= 0.")
        emulate = state.get("emulate")
        if emulate is not None and not (
            isinstance(emulate, (list, tuple))
            and len(emulate) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in emulate)
        ):
            raise ValueError(
                f"{said}: state['emulate']={emulate!r}, expected None or [world, batch], two ints >= 1. "
                f"Pass what DistributedLoader.state_dict() returned."
            )
        samples, size = self.distributed_sampler.num_samples, self._batch_size()
        drop_last = self._drop_last()
        per_epoch = samples // size if drop_last else -(-samples // size)
        if state["batches"] > per_epoch:
            raise ValueError(
                f"{said}: state['batches']={state['batches']} but an epoch "
                f"of this loader has {per_epoch} batches on this rank. Resume with the same loader settings."
            )
        world = self.distributed_sampler.num_replicas
        if state["batches"] and state["world_size"] != world:
            raise ValueError(
                f"{said}: saved mid-epoch with world size "
                f"{state['world_size']}, loaded with {world}: the batches would not line up. Resume with the "
                f"same world size, or from a checkpoint taken at an epoch boundary."
            )
        for key in ("seed_state", "generator"):
            value = state.get(key)
            if value is not None and not _is_generator_state(value):
                raise ValueError(
                    f"{said}: state[{key!r}] is not a CPU generator state (a uint8 tensor from "
                    f"torch.Generator.get_state()). Pass what DistributedLoader.state_dict() returned."
                )
        if state.get("generator") is not None and self.generator is None:
            raise ValueError(
                f"{said}: the loader was saved with its own generator= and this one has none. Build it as "
                f"it was built: DataLoader(..., generator=torch.Generator()) or fast_loader(..., seed=0)."
            )
        live = None if self._live is None else self._live()
        if live is not None and not live.finished:
            raise SpeedupsError(
                f"{said}: an iterator of this loader is still running (epoch {live.epoch}, "
                f"{live.done} batches handed out): it was built before the restore and would go on from the "
                f"old position. Load the checkpoint before the loop starts: load_checkpoint(path, "
                f"loader=loader, ...) first, then `for batch in loader:` (or train_step.epoch(loader))."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``iter()`` runs epoch ``state["epoch"]`` from batch ``state["batches"]``.

        Call it (or :func:`~speedups.load_checkpoint`) before ``iter(loader)``: the next pass then draws the
        same base seed for its workers as the uninterrupted run, without consuming the global RNG.

        Raises:
            ValueError: ``state`` is not what :meth:`state_dict` returns, or it is mid-epoch and was saved
                with another world size (its batches would not line up).
            SpeedupsError: an iterator of this loader is still running (load before the loop).
        """
        self._check_state(state)
        sampler = self.distributed_sampler
        if isinstance(sampler, RankSampler):
            emulate = state.get("emulate")
            sampler.emulate(*emulate) if emulate else sampler.emulate(None)
        self._next_epoch, self._resume_batches = int(state["epoch"]), int(state["batches"])
        self._current = None
        self._replay_seed = None if state.get("seed_state") is None else state["seed_state"].clone()
        if state.get("generator") is not None and self.generator is not None:
            self.generator.set_state(state["generator"])
        self._start_at(self._resume_batches)


def _same_generator_state(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return bool(torch.equal(a, b))


def _is_generator_state(value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        return False
    try:
        torch.Generator().set_state(value)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


class _Counting:
    """The DataLoader's iterator, counting batches handed out so the loader knows its position.

    ``next()`` is :meth:`draw` then :meth:`advance` (or :meth:`end` when the pass is exhausted). A
    :class:`~speedups.data.prefetching.DevicePrefetcher` calls the three itself: it draws a batch ahead of
    the one the step trains on, and advances the position only when it hands a batch to the step, so
    ``state_dict()`` (and a checkpoint taken then) is the step's position, never the prefetcher's.
    """

    def __init__(self, loader: DistributedLoader, inner: Iterator[Any], epoch: int, skip: int) -> None:
        self._loader, self._inner, self.epoch, self.done = loader, inner, epoch, skip
        self.finished = False

    def __iter__(self) -> _Counting:
        return self

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __next__(self) -> Any:
        try:
            batch = self.draw()
        except StopIteration:
            self.end()
            raise
        self.advance()
        return batch

    def draw(self) -> Any:
        """Return the pass's next batch without counting it as handed out (the position stays).

        Raises:
            StopIteration: the pass has no batch left; the pass itself ends at :meth:`end`.
        """
        return next(self._inner)

    def advance(self) -> None:
        """Count one more batch as handed out to the step: the loader's position moves past it."""
        self.done += 1
        if self._loader._current is not None and self._loader._current[0] == self.epoch:
            self._loader._current = (self.epoch, self.done)

    def end(self) -> None:
        """End the pass: every batch was handed out, the loader's position is the next epoch's start."""
        self.finished = True
        loader = self._loader
        if loader._current is not None and loader._current[0] == self.epoch:
            loader._current = None  # finished: the next pass is the next epoch
        if loader._live is not None and loader._live() is self:
            loader._start_at(0)  # a resumed pass is over: len(loader) is a whole epoch's again


def _stream(
    loader: DataLoader, said: str, shuffle: bool | None, even: bool, place: tuple[int, int]
) -> DataLoader:
    """``loader`` over an IterableDataset, rebuilt around a :class:`RankStream` (or over the dataset as it
    is, when it declares ``splits_by_rank = True``)."""
    if shuffle:
        raise ValueError(
            f"{said}: an IterableDataset is read in its own order; shuffle it inside the stream (a shuffle "
            f"buffer) and leave shuffle=None."
        )
    dataset: Any = unwrapped(loader.dataset)
    if not splits_itself(dataset):
        dataset = RankStream(dataset, rank=place[0], world_size=place[1], even=even)
    kwargs = _settings(loader) | {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    return build_loader(DataLoader, dataset, **kwargs)


def _placement(said: str, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world size)``: the arguments, else the launcher's; checked against each other."""
    here = env.placement(call="distributed()")
    num_replicas = here.world_size if world_size is None else world_size
    this_rank = here.rank if rank is None else rank
    if this_rank >= num_replicas:
        raise ValueError(
            f"{said}: rank={this_rank} must be below world_size={num_replicas}. Pass a rank in "
            f"range({num_replicas}), or leave rank and world_size to the launcher (None)."
        )
    return this_rank, num_replicas


def _settings(loader: DataLoader) -> dict[str, Any]:
    """The loader's settings a rebuilt one keeps (worker settings only where it has workers)."""
    params = inspect.signature(DataLoader.__init__).parameters
    kwargs = {
        name: getattr(loader, name) for name in _PASSED_THROUGH if name in params and hasattr(loader, name)
    }
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    else:  # workers that outlive a stop signal until the main process has saved, and persist exactly
        kwargs["worker_init_fn"] = sheltered(kwargs.get("worker_init_fn"))
        kwargs["persistent_workers"] = rebuilt_persistence(loader)
    return kwargs


_PASSED_THROUGH = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def distributed(
    loader: DataLoader,
    *,
    shuffle: bool | None = None,
    even: bool = True,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    sample_seeds: bool | None = None,
) -> DistributedLoader | DataLoader:
    """Return ``loader`` rebuilt with a ``DistributedSampler``: each rank gets its share of every epoch.

    The new loader keeps every setting of the original (batch size, ``drop_last``, workers, ``collate_fn``,
    ``generator``, ...); only the sampler changes, also inside a ``BatchSampler``. It is a
    :class:`DistributedLoader`: each ``iter()`` advances the epoch, the same on all ranks, so no
    ``set_epoch`` can be forgotten; ``set_epoch(k)`` or ``load_state_dict`` resume exactly, mid-epoch too.
    ``even=True`` (training) pads as ``DistributedSampler`` does, so every rank gets as many batches (DDP's
    all-reduce needs that). ``even=False`` (evaluation) gives each sample to exactly one rank, so a metric
    does not depend on the world size; batch counts may then differ by one: run no per-batch collective,
    reduce once after the loop (``LossTracker(all_ranks=True)`` or :func:`~speedups.gather`). The original
    loader is not modified. Workers persist and draw what fresh ones draw, epoch after epoch, as
    ``fast_loader``'s do (unless the original has torch's own ``persistent_workers=True``). A loader that
    already has a ``DistributedSampler`` (code written for torchrun) is adopted, never split twice: the same
    ranks, shuffling, seed and ``drop_last``, with ``set_epoch(e)`` on pass ``e``; arguments that contradict
    that sampler raise. A loader over an ``IterableDataset`` becomes a plain ``DataLoader`` over a
    :class:`~speedups.data.rank_stream.RankStream`: the stream dealt round-robin to every (rank, loader
    worker), each sample read once per epoch (``even`` drops a last partial round so every rank gets as
    many batches); a dataset with ``splits_by_rank = True`` is trusted to split itself.
    ``sample_seeds=True`` seeds each sample's RNGs from (seed, epoch, index), as ``fast_loader`` can.

    Sync points: none (each rank computes the same permutation from ``seed + epoch``).

    Args:
        loader: a map-style ``DataLoader`` whose sampler is a ``RandomSampler`` (shuffled),
            a ``SequentialSampler`` (not shuffled), a ``DistributedSampler`` (adopted), or one of them inside
            a ``BatchSampler``; or a ``DataLoader`` over an ``IterableDataset``.
        shuffle: shuffle every epoch; None keeps what the original did.
        even: pad so every rank gets equal batch counts (True, training), or give every sample exactly once
            (False, evaluation).
        seed: the shuffling seed; must be the same on all ranks. The order comes from ``seed + epoch``, not
            from the loader's ``generator`` (nor ``fast_loader(..., seed=3)``): pass ``seed=3`` here too.
        rank: this process's global rank; None reads it from the process group or ``RANK``/``SLURM_PROCID``
            (the global rank, never the local one).
        world_size: the number of ranks; None reads it like ``rank``.
        sample_seeds: per-sample random streams; None keeps the loader's (with ``fast_loader``'s ``seed=``
            if it had one, else ``seed``), True adds them (from ``seed``) where missing, False removes them.

    Returns:
        A :class:`DistributedLoader`; for an ``IterableDataset``, a ``DataLoader`` (its position is the
        stream's, not checkpointed).

    Raises:
        TypeError: ``loader`` is not a DataLoader, holds a sampler that cannot be split across ranks
            (weighted, subset, custom), or has workers and a ``worker_init_fn`` they cannot call with the
            worker id.
        ValueError: ``rank``/``world_size`` out of range, ``loader`` is already a :class:`DistributedLoader`,
            an argument contradicts the ``DistributedSampler`` it holds (or the seed of ``fast_loader``'s
            per-sample order), or ``shuffle=True`` or ``sample_seeds=True`` for a stream.
        SpeedupsError: the environment contradicts itself.

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
        >>> ranks = [distributed(loader, rank=r, world_size=2) for r in (0, 1)]
        >>> [len(r) for r in ranks]                    # 5 samples each: batches of 2, 2, 1
        [3, 3]
        >>> epoch0 = [sorted(x for b in r for x in b.tolist()) for r in ranks]
        >>> sorted(epoch0[0] + epoch0[1]) == list(range(10))   # disjoint, covering everything
        True
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"distributed(loader={type(loader).__name__}): expected a torch.utils.data.DataLoader. "
            f"Build one first: distributed(DataLoader(dataset, batch_size=..., shuffle=True))."
        )
    if isinstance(loader, DistributedLoader):
        raise ValueError(f"distributed(loader={type(loader).__name__}): this loader is already distributed.")
    users_dataset = unwrapped(loader.dataset)  # inside what fast_loader wrapped
    said = (
        f"distributed(shuffle={shuffle!r}, even={even!r}, seed={seed!r}, rank={rank!r}, "
        f"world_size={world_size!r}"
    )
    said += ")" if sample_seeds is None else f", sample_seeds={sample_seeds!r})"
    with validate.arguments(said):
        if shuffle is not None:
            validate.flag(shuffle, "shuffle")
        validate.flag(even, "even")
        if sample_seeds is not None:
            validate.flag(sample_seeds, "sample_seeds")
        seeded = sample_seeds or (sample_seeds is None and isinstance(users_dataset, SeededSamples))
        low = 0 if seeded else -(2**63)  # seed + epoch must fit a generator's seed
        validate.integer(seed, "seed", minimum=low, maximum=2**63 - 1, example="0 (the same on every rank)")
        validate.integer(world_size, "world_size", minimum=1, none_ok=True)
        validate.integer(rank, "rank", minimum=0, none_ok=True)
        if sample_seeds:
            refuse_stream(users_dataset, "or leave sample_seeds out")
        if loader.num_workers > 0:  # torch calls it only inside a worker, at the first batch
            check_worker_init_fn(loader.worker_init_fn, "loader.worker_init_fn")
    if isinstance(users_dataset, IterableDataset):
        return _stream(loader, said, shuffle, even, _placement(said, rank, world_size))
    batch_sampler = unwrapped(loader.batch_sampler)  # the user's, inside what fast_loader wrapped
    if isinstance(batch_sampler, SampleKeys):  # fast_loader(batch_sampler=..., sample_seeds=True)
        batch_sampler = batch_sampler.sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise TypeError(
            f"distributed(loader): its batch_sampler is a {type(batch_sampler).__name__}, which cannot be "
            f"rebuilt around a DistributedSampler. Give the DataLoader a batch_size and a RandomSampler or "
            f"SequentialSampler instead, or split indices by rank inside your batch sampler."
        )
    inner: Any = unwrapped(loader.sampler if batch_sampler is None else batch_sampler.sampler)
    keys_order = isinstance(inner, SampleKeys) and inner.is_seeded_order
    if isinstance(inner, SampleKeys):
        inner = inner.sampler
    given = keys_order and isinstance(users_dataset, SeededSamples) and users_dataset.samples_seed_given
    if keys_order and not given:  # fast_loader(..., sample_seeds=True) without seed=: ours, as for any
        was_shuffled = bool(inner.shuffle)
    elif keys_order:  # fast_loader(..., seed=..., sample_seeds=True)'s one-rank order: split, from its seed
        if seed not in (0, inner.seed):
            raise ValueError(
                f"{said}: the loader orders its samples from seed={inner.seed} (fast_loader(..., seed=..., "
                f"sample_seeds=True)), and seed={seed!r} contradicts it. Leave seed out, or pass "
                f"seed={inner.seed}."
            )
        seed, was_shuffled = inner.seed, bool(inner.shuffle)
    elif isinstance(inner, DistributedSampler):  # code written for torchrun: adopt its split, not split it
        check_adoptable(inner, loader)
        shuffle, seed, rank, world_size = adopted(inner, shuffle, seed, rank, world_size, said)
        was_shuffled = shuffle
    elif type(inner) is RandomSampler:
        if inner.replacement or inner._num_samples is not None:
            raise TypeError(
                "distributed(loader): its RandomSampler draws with replacement or a num_samples, which a "
                "DistributedSampler cannot reproduce. Use shuffle=True without those."
            )
        was_shuffled = True
    elif type(inner) is SequentialSampler:
        was_shuffled = False
    else:
        raise TypeError(
            f"distributed(loader): its sampler is a {type(inner).__name__}; only a RandomSampler "
            f"(shuffle=True) or SequentialSampler (shuffle=False) can be split across ranks. For weighted or "
            f"subset sampling, split the indices by rank yourself."
        )
    this_rank, num_replicas = _placement(said, rank, world_size)
    sampler = RankSampler(
        users_dataset,
        num_replicas=num_replicas,
        rank=this_rank,
        shuffle=was_shuffled if shuffle is None else shuffle,
        seed=seed,
        even=even,
    )
    if isinstance(inner, DistributedSampler) and inner.drop_last and even:  # its split, tail dropped
        sampler.drop_last, sampler.num_samples, sampler.total_size = True, inner.num_samples, inner.total_size
    dataset, order = _seeded(users_dataset, sampler, sample_seeds, seed)
    kwargs = _settings(loader)
    if isinstance(dataset, SeededSamples) and kwargs.get("generator") is None:  # as fast_loader does: the
        kwargs["generator"] = torch.Generator().manual_seed(dataset.samples_seed)  # global RNG stays alone
    if loader.batch_size is not None:  # built from batch_size: keep batch_size and drop_last as attributes
        kwargs.update(sampler=order, batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif batch_sampler is not None:  # the user's own BatchSampler: rebuild it around the new sampler
        kwargs["batch_sampler"] = BatchSampler(order, batch_sampler.batch_size, batch_sampler.drop_last)
    else:
        kwargs.update(sampler=order, batch_size=None)
    return build_loader(DistributedLoader, dataset, **kwargs)


def _seeded(
    dataset: Any, sampler: RankSampler, sample_seeds: bool | None, seed: int
) -> tuple[Any, RankSampler | SampleKeys]:
    """The dataset and sampler of the rebuilt loader, with per-sample streams if asked or already there."""
    if isinstance(dataset, SeededSamples):
        if sample_seeds is False:
            return dataset.dataset, sampler
        if not dataset.samples_seed_given:  # fast_loader's seed came from torch.initial_seed(): ranks differ
            dataset = SeededSamples(dataset.dataset, seed)
    elif sample_seeds:
        dataset = SeededSamples(dataset, seed)
    else:
        return dataset, sampler
    return dataset, SampleKeys(sampler, drive=False)  # the keys follow the epoch this loader sets

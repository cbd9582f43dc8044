"""Resuming on another layout: another number of processes, micro-steps per window or batch size.

A job preempted on 2 GPUs often comes back on 1 or 4, keeping its global batch (processes x micro-steps per
window x batch size) by changing the accumulation. A :class:`~speedups.DistributedLoader`'s global order is
the same for any world size (a ``DistributedSampler`` permutation of ``seed + epoch``, dealt round-robin), so
the first ``k * world * batch`` samples of an epoch are the same whatever the layout: the run continues from
the same sample. This module checks that the continuation is exact, and says what would make it so when it
is not:

- the global batch is the same (``world x every x batch``);
- an epoch holds the same samples in both layouts (padding and ``drop_last`` depend on the world size);
- every micro-step is full-size in both layouts, unless the step returns ``(loss, num_items)`` (a partial
  micro-step weighs its samples by ``1 / (its size x micro-steps in the window)``, which differs);
- the position in the epoch and in the open window are whole micro-steps of the new layout.

Then each object with per-rank state merges what its ranks saved (``_merge_rank_states``): the step sums the
ranks' pending gradients into this layout's, the loader continues at the same sample, a tracker keeps the
job's totals. Objects without such a method must have saved the same state on every rank. Randomness drawn
in the training processes (dropout) follows the new layout: each rank keeps its RNG states.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from speedups._helpers import env
from speedups._helpers.layout import LayoutChange
from speedups.checkpoint.entries import saved_object
from speedups.checkpoint.rank_states import is_per_rank, state_of_this_rank
from speedups.data.distributed_loader import DistributedLoader
from speedups.errors import SpeedupsError

__all__ = ["LayoutError", "changes_layout", "is_step", "states_for_this_layout"]


class LayoutError(SpeedupsError):
    """The checkpoint cannot continue exactly on this run's layout (nothing was loaded). A run directory
    then tries the checkpoint before it (a periodic one, at a window boundary, usually can)."""


def is_step(target: Any) -> bool:
    """An ``@accumulate`` step (told apart by what it shows, not its class: it lives beside this package)."""
    return callable(getattr(target, "_merge_rank_states", None)) and all(
        hasattr(target, a) for a in ("every", "pending", "num_updates")
    )


def _saved_states(contents: Any, entry: str) -> list[Any]:
    """What every rank saved under ``entry``, in rank order (rank 0's only where the file holds no others)."""
    first = contents.entries[entry]
    others = (contents.per_rank or {}).get(entry)
    return [first] if not others else [first, *others[1:]]


def changes_layout(contents: Any, objects: Mapping[str, Any], entry_of: Mapping[str, str]) -> bool:
    """Whether ``contents`` was saved on another layout than this run's, for the objects being loaded."""
    if contents.foreign or contents.world_size is None:
        return False
    targets = {name: saved_object(obj) for name, obj in objects.items()}
    if contents.world_size != env.world_size() and any(is_per_rank(t) for t in targets.values()):
        return True
    for name, target in targets.items():
        saved = contents.entries[entry_of[name]]
        if not isinstance(saved, Mapping):
            continue
        if is_step(target) and saved.get("every") not in (None, target.every):
            return True
        if isinstance(target, DistributedLoader) and saved.get("batch_size") not in (None, _batch(target)):
            return True
    return False


def _batch(loader: DistributedLoader) -> int:
    return loader.state_dict()["batch_size"]


class _Epoch:
    """One layout's view of an epoch: samples used, samples per micro-step (all ranks), per-rank samples."""

    def __init__(self, world: int, batch: int, rank_samples: int, drop_last: bool, known_batch: bool = True):
        self.world, self.batch, self.rank_samples, self.known_batch = world, batch, rank_samples, known_batch
        per_rank = rank_samples // batch * batch if drop_last else rank_samples
        self.used = per_rank * world  # samples trained on per epoch
        self.micro = world * batch  # samples per micro-step, all ranks together
        self.batches = rank_samples // batch if drop_last else -(-rank_samples // batch)  # per rank and epoch

    def consumed(self, batches: int) -> int:
        """Samples of the epoch (all ranks) handed out after ``batches`` batches on each rank."""
        return min(batches * self.batch, self.rank_samples) * self.world if batches else 0

    def describe(self, every: int | None) -> str:
        procs = _procs(self.world)
        window = f" x accumulate({every})" if every is not None else ""
        if not self.known_batch:  # no loader was passed: batches are taken to be alike
            return f"{procs}{window} = {self.micro * (every or 1)} micro-batches per optimizer step"
        return (
            f"{procs}{window} x batch {self.batch} = {self.micro * (every or 1)} samples per optimizer step"
        )


def states_for_this_layout(
    said: str, contents: Any, objects: Mapping[str, Any], entry_of: Mapping[str, str]
) -> dict[str, Any]:
    """This rank's state for every object, merged from what each rank saved on the checkpoint's layout.

    Raises:
        SpeedupsError: the run cannot continue exactly on this layout (the message says what would keep
            it): another global batch, epochs of other samples, partial micro-steps, a position that is not
            a whole micro-step here, a window saved mid-way without every rank's gradients, or an object
            whose per-rank states differ and that cannot merge them.
    """
    saved_world, world, rank = int(contents.world_size), env.world_size(), env.rank()
    targets = {name: saved_object(obj) for name, obj in objects.items()}
    loaders = {n: t for n, t in targets.items() if isinstance(t, DistributedLoader)}
    steps = {n: t for n, t in targets.items() if is_step(t)}
    feeds = [_saved_states(contents, entry_of[n])[0].get("feed") for n in steps]
    old, new, position, loader_name = _epochs(said, contents, loaders, entry_of, saved_world, feeds)
    change, consumed = LayoutChange(saved_world, world, rank), None
    if loader_name is not None:
        consumed = old.consumed(position)
        batches = _new_batches(said, loader_name, consumed, old, new)
        change = LayoutChange(saved_world, world, rank, batches=batches)
    changes = {  # each step its own window (a GAN's two steps)
        name: _place_step(
            said, name, step, _saved_states(contents, entry_of[name]), old, new, change, consumed
        )
        for name, step in steps.items()
    }
    if not steps and loader_name is not None and position and old.micro != new.micro:
        raise LayoutError(
            f"{said}: loader {loader_name!r} was saved mid-epoch on {_procs(old.world)} x batch {old.batch} "
            f"({old.micro} samples per micro-step), and here it hands out {new.micro} per micro-step "
            f"({_procs(new.world)} x batch {new.batch}): without the @accumulate step saved with it, the "
            f"samples per optimizer step cannot be checked nor its window placed. Pass it too: "
            f"load_checkpoint(path, ..., loader=loader, step=train_step)."
        )
    out: dict[str, Any] = {}
    for name, target in targets.items():
        entry = entry_of[name]
        if not is_per_rank(target):
            out[name] = contents.entries[entry]
            continue
        states = _saved_states(contents, entry)
        merge = getattr(target, "_merge_rank_states", None)
        try:
            if name in changes or name == loader_name:  # placed in this layout's windows and batches
                out[name] = merge(states, changes.get(name, change))  # type: ignore[misc]
            elif saved_world == world:  # the same ranks: each its own state
                out[name] = state_of_this_rank(entry, contents.entries[entry], contents.per_rank)
            elif callable(merge):
                out[name] = merge(states, change)
        except (TypeError, ValueError) as err:  # a state the object refuses, named as load_checkpoint does
            raise type(err)(f"{said}: {name}: {err}") from err
        if name in out:
            continue
        if all(_same(states[0], s) for s in states[1:]):
            out[name] = states[0]
        else:
            raise LayoutError(
                f"{said}: {name!r} ({type(target).__name__}) saved another state on each of its "
                f"{saved_world} processes, and it has no way to merge them for {world}. Resume on "
                f"{saved_world} processes, or leave {name}= out of load_checkpoint."
            )
    return out


def _epochs(
    said: str, contents: Any, loaders: Mapping[str, DistributedLoader], entry_of: Mapping[str, str],
    saved_world: int, feeds: list[Any],
) -> tuple[_Epoch, _Epoch, int, str | None]:  # fmt: skip
    """Both layouts' epochs as the training loader shows them, its saved position, and its name.

    The training loader is the only one passed, else the one saved mid-epoch, else the one the steps'
    ``epoch()`` iterated (``feeds``: what each step recorded of it). Without a loader, micro-steps are taken
    to have the same batch on both layouts (one sample per "batch").
    """
    world = env.world_size()
    if not loaders:
        return _Epoch(saved_world, 1, 1, False, False), _Epoch(world, 1, 1, False, False), 0, None
    name = _training_loader(said, contents, loaders, entry_of, feeds)
    loader = loaders[name]
    saved = contents.entries[entry_of[name]]
    here = loader.state_dict()
    batch = saved.get("batch_size", here["batch_size"])
    rank_samples = saved.get("rank_samples")
    if rank_samples is None:  # an older file: the padded share of the dataset on the saving layout
        rank_samples = math.ceil(here["samples"] / saved_world)
    old = _Epoch(saved_world, batch, rank_samples, saved.get("drop_last", here["drop_last"]))
    new = _Epoch(world, here["batch_size"], here["rank_samples"], here["drop_last"])
    if saved.get("samples", here["samples"]) != here["samples"]:
        raise SpeedupsError(
            f"{said}: loader {name!r} was saved over a dataset of {saved['samples']} samples; this one has "
            f"{here['samples']}. Resume with the same dataset."
        )
    if old.used != new.used:
        raise LayoutError(
            f"{said}: loader {name!r}: an epoch trains on {old.used} samples on {saved_world} processes "
            f"(batch {old.batch}) and on {new.used} here ({world} processes, batch {new.batch}): "
            f"DistributedSampler pads the dataset to a multiple of the world size, and drop_last drops a "
            f"partial batch per rank, so the epochs would differ. Resume on a layout where both are whole (a "
            f"dataset size divisible by every world size x batch you use), or on {saved_world} processes."
        )
    return old, new, int(saved.get("batches", 0)), name


def _training_loader(
    said: str, contents: Any, loaders: Mapping[str, DistributedLoader], entry_of: Mapping[str, str],
    feeds: list[Any],
) -> str:  # fmt: skip
    """The name of the loader that feeds the steps (see :func:`_epochs`).

    Raises:
        LayoutError: several loaders were saved mid-epoch, or several could be the training loader.
    """
    if len(loaders) == 1:
        return next(iter(loaders))
    moving = [n for n in loaders if contents.entries[entry_of[n]].get("batches")]
    if len(moving) > 1:
        raise LayoutError(
            f"{said}: {sorted(moving)} were all saved mid-epoch; on another layout only one loader (the "
            f"training loader) can be placed. Resume on the same layout, or save at an epoch boundary."
        )
    if moving:
        return moving[0]
    keys = ("batch_size", "samples", "world_size")
    fed = [
        n for n in loaders
        if any(isinstance(f, Mapping) and all(f.get(k) == contents.entries[entry_of[n]].get(k) for k in keys)
               for f in feeds)
    ]  # fmt: skip
    if len(fed) == 1 or (not feeds and loaders):
        return fed[0] if fed else sorted(loaders)[0]  # no step: any loader at an epoch start will do
    which = "several of them could be" if fed else "the checkpoint does not say (epoch(loader) records it)"
    raise LayoutError(
        f"{said}: {sorted(loaders)} were passed, and the step's global batch depends on the one it trains "
        f"on, which {which}. Load the training loader with the step here, and the others by themselves: "
        f"load_checkpoint(path, other_loader=other_loader)."
    )


def _new_batches(said: str, name: str, consumed: int, old: _Epoch, new: _Epoch) -> int:
    """The batches per rank here that hand out the ``consumed`` samples; refused if not a whole number."""
    if consumed >= new.used:
        return new.batches  # the epoch was over: nothing of it is left here either
    if consumed % new.micro:
        raise LayoutError(
            f"{said}: loader {name!r} was saved {consumed} samples into its epoch (all ranks), which is not "
            f"a whole number of this run's micro-steps ({_procs(new.world)} x batch {new.batch} = "
            f"{new.micro} samples), so no rank could start at that sample. Resume on a layout whose "
            f"micro-step divides {consumed} (e.g. {_procs(old.world)} x batch {old.batch}), or from a "
            f"checkpoint at a window boundary."
        )
    return consumed // new.micro


def _place_step(
    said: str, name: str, step: Any, states: list[Any], old: _Epoch, new: _Epoch, change: LayoutChange,
    consumed: int | None,
) -> LayoutChange:  # fmt: skip
    """Check that ``step`` can continue the saved window here; return ``change`` with its window placed.

    ``consumed``: the samples of the epoch handed out when it was saved (all ranks), None without a loader.
    """
    first = states[0] if isinstance(states[0], Mapping) else {}
    numbers = [first.get("every"), first.get("pending", 0), first.get("step", 0)]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
        return change  # not a step's state: its own check names what is wrong
    every, pending, micro = (int(v) for v in numbers)
    items = first.get("mode") == "items"
    here = step.every
    if every * old.micro != here * new.micro:
        keep = _fit(every * old.micro, new.micro)
        fix = (
            f"decorate the step with accumulate({keep}, ...) here." if keep else
            f"no whole accumulation count does it on {_procs(new.world)}"
            + (f" with batch {new.batch}" if new.known_batch else "")
            + "; change the batch size or the number of processes."
        )  # fmt: skip
        unknown = "" if new.known_batch else (
            " (No loader was passed, so micro-batches are taken to be alike; if the batch size changed too, "
            "pass loader=loader so the samples per optimizer step are checked.)"
        )  # fmt: skip
        raise LayoutError(
            f"{said}: {name!r} was saved on {old.describe(every)}; this run has {new.describe(here)}: "
            f"resuming would change the global batch, so the training. Keep {every * old.micro}: "
            f"{fix}{unknown}"
        )
    if not items and consumed is not None and (old.used % old.micro or new.used % new.micro):
        raise LayoutError(
            f"{said}: {name!r}: an epoch of {old.used} samples is not a whole number of micro-steps on "
            f"both layouts ({old.micro} and {new.micro} samples each): its last, partial micro-step would "
            f"weigh its samples differently. Use a dataset size (or drop_last) that gives whole micro-steps "
            f"on both, or return (loss, num_items) from the step, which weighs every sample alike on any "
            f"layout."
        )
    if pending and len(states) < old.world:
        raise LayoutError(
            f"{said}: {name!r} was saved with {pending} of {every} micro-steps of a window pending, and "
            f"the file holds rank 0's pending gradients only (saved by rank 0 alone, or by an older "
            f"speedups): the window cannot continue on another layout. Resume on {old.world} processes, or "
            f"from a checkpoint at a boundary."
        )
    window = pending * old.micro  # samples of the open window so far, all ranks
    at_end = consumed is not None and consumed >= old.used  # the window holds the epoch's last samples
    if pending and at_end and old.used % old.micro:  # its last, partial micro-step (items mode only)
        window -= old.micro - old.used % old.micro
    if window % new.micro and not (items and at_end):  # items: partial micro-steps weigh alike
        raise LayoutError(
            f"{said}: {name!r} was saved after {pending} of {every} micro-steps of a window ({window} "
            f"samples on {_procs(old.world)}), which is not a whole number of "
            f"this run's micro-steps ({new.micro} samples): resume on a layout whose micro-step divides "
            f"{window}, or from a checkpoint at a window boundary."
        )
    pending_here = -(-window // new.micro)
    if pending_here >= here:  # the epoch's short last window fills whole micro-steps here: it would be due
        raise LayoutError(
            f"{said}: {name!r} was saved after the last micro-step of an epoch, before its short window was "
            f"applied; on this layout those {window} samples make {pending_here} micro-steps, a whole "
            f"window, which a checkpoint cannot hold unapplied. Resume on {_procs(old.world)} x batch "
            f"{old.batch}, or from a checkpoint saved after train_step.epoch(loader) ended."
        )
    return LayoutChange(
        change.saved_world, change.world, change.rank, change.batches,
        pending=pending_here, micro_steps=round(micro * old.micro / new.micro),
    )  # fmt: skip


def _procs(world: int) -> str:
    return f"{world} process{'es' if world > 1 else ''}"


def _fit(samples: int, micro: int) -> int:
    """The accumulation count that makes ``samples`` per optimizer step from micro-steps of ``micro``; 0
    when none does."""
    return samples // micro if samples % micro == 0 and samples >= micro else 0


def _same(a: Any, b: Any) -> bool:
    """Whether two saved states are equal (tensors compared by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
        )  # fmt: skip
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b

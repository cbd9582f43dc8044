"""One small training loop, written twice: with speedups' levers, and by hand in plain PyTorch.

A :class:`Recipe` says which levers are on; :func:`run_speedups` trains with speedups' spelling of each and
:func:`run_plain` with the hand-written equivalent a PyTorch user would write (the reference,
:func:`run_reference`). Both start
from the same seeds and return an :class:`Outcome`: the weights, the buffers, every loss the loop saw (or
the tracker's epoch means) and the global RNG state at the end, which :func:`differences` compares.

The loop is chosen so that each lever has something to get wrong: a conv stem (``fast_kernels`` turns it
channels_last), batch norm (running statistics: micro-batches, out-of-memory retries), two identical blocks
(``compile_blocks``, ``checkpoint_activations``), an Adam whose implementation is picked (fused, foreach,
for-loop), 36 samples in batches of 8 (a short last batch, and with ``every=2`` a short last window that
``epoch()`` flushes), random augmentation drawn in ``__getitem__`` (worker seeds), and with ``stateful`` a
dataset that changes: labels rewritten in place each epoch, a generator of its own, a ``worker_init_fn``
that rescales each worker's copy. Used by ``test_pairs.py`` in one process and by
``tests/workers/seam_pairs_ddp.py`` on 2 gloo ranks (``ddp=True``: ``ddp_wrap`` and ``distributed()``
against DDP and ``DistributedSampler`` by hand).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

SAMPLES, BATCH, EPOCHS, LR = 36, 8, 2, 1e-2
RESTORE_AT = 7  # the micro-step after which fast_kernels is restored (mid-run)
BLOCKS = "blocks.*"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Which levers a loop pulls (the same for both spellings)."""

    workers: int = 0  # loader worker processes (speedups' persist; the reference's start every epoch)
    stateful: bool = False  # a dataset that changes between epochs and in its workers
    every: int = 1  # micro-steps per optimizer step
    micro: int | str | None = None  # rows per micro-batch, or "auto"
    oom_above: int | None = None  # with micro="auto": a forward of more rows runs out of memory
    bf16: bool = False  # bf16 autocast on the CPU
    tracker: bool = False  # the loss read through a LossTracker, per epoch
    clip: float | None = None  # max_grad_norm
    compile: bool = False  # compile_blocks with inductor
    checkpoint: bool = False  # checkpoint_activations on the blocks
    fast_kernels: bool = False  # fast_kernels(model), restored after micro-step RESTORE_AT
    optimizer: str = "plain"  # "plain" (for-loop), "foreach" or "fused" Adam
    resume_at: int | None = None  # save after this micro-step, resume in fresh objects, continue
    ddp: bool = False  # 2 gloo ranks (tests/workers/seam_pairs_ddp.py)


@dataclasses.dataclass
class Outcome:
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    losses: list[float]
    rng: torch.Tensor


# ------------------------------------------------------------------------------------------- the model
class OomAbove(nn.Module):
    """Runs out of memory on more rows than ``limit`` (a real forward's failure, after batch norm ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 1 << 30

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {h.shape[0]} rows > {self.limit}")
        return h


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class SeamNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias before batch norm: it would be a direction the loss cannot see, where Adam turns rounding
        # noise in a zero gradient into steps of the learning rate's size
        self.stem = nn.Conv2d(4, 8, 3, padding=1, bias=False)  # (several channels: channels_last differs)
        self.proj = nn.Linear(32, 32, bias=False)
        self.norm = nn.BatchNorm1d(32)
        self.oom = OomAbove()
        self.blocks = nn.ModuleList(Block(32) for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(self.stem(x.view(-1, 4, 2, 2)).flatten(1)))
        h = self.oom(h)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# ------------------------------------------------------------------------------------------- the data
class Samples(Dataset):
    """36 samples with random augmentation; ``stateful``: labels rewritten in place after each epoch
    (pseudo-labels), a generator of the dataset's own for the augmentation, a scale ``rescale`` changes."""

    def __init__(self, stateful: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 1, generator=g)
        self.offset = torch.zeros(SAMPLES, 1)
        self.scale = 1.0
        self.own = torch.Generator().manual_seed(5) if stateful else None

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(16, generator=self.own)  # the worker's (or the dataset's own) stream
        return self.x[i] * self.scale + 0.1 * noise, self.y[i] + self.offset[i]

    def after_epoch(self, epoch: int) -> None:
        if self.own is not None:
            self.offset[:] = 0.5 * (epoch + 1)  # in place: no attribute is reassigned


def rescale(worker_id: int) -> None:
    """A worker_init_fn that changes its worker's copy of the dataset, relative to what it holds."""
    info = get_worker_info()
    assert info is not None
    info.dataset.scale = info.dataset.scale * 1.5


# ------------------------------------------------------------------------------------------- the loops
def _optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    kind = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    return torch.optim.Adam(model.parameters(), lr=LR, **kind[recipe.optimizer])


def _model(recipe: Recipe, *, ours: bool) -> nn.Module:
    torch.manual_seed(0)
    model = SeamNet()
    if ours and recipe.oom_above is not None:
        model.oom.limit = recipe.oom_above
    return model


def _outcome(model: nn.Module, losses: list[float]) -> Outcome:
    return Outcome(
        [p.detach().clone() for p in model.parameters()],
        [b.detach().clone() for b in model.buffers()],
        losses,
        torch.get_rng_state(),
    )


def run_speedups(recipe: Recipe, folder: str | None = None) -> Outcome:
    """The loop with speedups' levers, as the docs teach them (with ``resume_at``, a save to ``folder``, one
    path on every rank, a temporary one by default, and a resume in fresh objects)."""
    if recipe.resume_at is None:
        return _speedups_part(recipe, None, None)
    with tempfile.TemporaryDirectory() as own:
        path = os.path.join(folder or own, "ckpt.pt")
        before = _speedups_part(recipe, None, path)  # stops after saving
        after = _speedups_part(recipe, path, None)
    after.losses = before.losses + after.losses
    return after


def _speedups_part(recipe: Recipe, resume: str | None, save: str | None) -> Outcome:
    with warnings.catch_warnings():  # a dataset that changes: its workers restart, and the loader says so
        warnings.filterwarnings("ignore", "for batch in loader: .* starts fresh workers", Warning)
        return _speedups_loop(recipe, resume, save)


def _speedups_loop(recipe: Recipe, resume: str | None, save: str | None) -> Outcome:
    from speedups import (
        LossTracker,
        SpeedupsWarning,
        accumulate,
        checkpoint_activations,
        compile_blocks,
        ddp_wrap,
        distributed,
        fast_kernels,
        fast_loader,
        load_checkpoint,
        mixed_precision,
        save_checkpoint,
    )

    torch.manual_seed(0)
    dataset = Samples(recipe.stateful)
    init = rescale if recipe.stateful else None
    # A resume replays augmentation drawn in workers only with per-sample seeds (docs/checkpoints.md): the
    # resumed pass skips the batches already trained on without loading them.
    seeded = recipe.workers > 0 and recipe.resume_at is not None
    loader: Any = fast_loader(dataset, BATCH, shuffle=True, num_workers=recipe.workers, seed=0,
                              worker_init_fn=init, sample_seeds=seeded)  # fmt: skip
    if recipe.ddp or recipe.resume_at is not None:
        loader = distributed(loader, seed=0)  # knows its epoch and position
    model = _model(recipe, ours=True)
    if recipe.checkpoint:
        checkpoint_activations(model, BLOCKS)
    if recipe.compile:
        compile_blocks(model, BLOCKS)
    switch = None
    if recipe.fast_kernels and (resume is None or recipe.resume_at < RESTORE_AT):  # before DDP, as taught
        with warnings.catch_warnings():  # TF32 and cuDNN autotuning do not apply on the CPU: it says so
            warnings.filterwarnings("ignore", "fast_kernels.*do not apply here", SpeedupsWarning)
            switch = fast_kernels(model)
    wrapped = ddp_wrap(model, device="cpu") if recipe.ddp else model
    optimizer = _optimizer(recipe, wrapped)
    amp = mixed_precision("bf16", device_type="cpu") if recipe.bf16 else None
    tracker = LossTracker() if recipe.tracker else None

    @accumulate(recipe.every, optimizer, max_grad_norm=recipe.clip, micro_batch_size=recipe.micro,
                model=wrapped)  # fmt: skip
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with amp if amp is not None else contextlib.nullcontext():
            out = wrapped(x)
        return F.mse_loss(out.float(), y)

    done, start = 0, 0
    if resume is not None:
        extra = load_checkpoint(resume, model=wrapped, optimizer=optimizer, step=train_step, loader=loader,
                                **({"tracker": tracker} if tracker is not None else {}))  # fmt: skip
        done, start = extra["micro_steps"], extra["epoch"]
        dataset.after_epoch(start - 1) if start else None  # the user's per-epoch state, set again
    losses: list[float] = []
    for epoch in range(start, EPOCHS):
        for x, y in train_step.epoch(loader):
            loss = train_step(x, y)
            done += 1
            if tracker is not None:
                tracker.update(loss, n=len(y))
            else:
                losses.append(float(loss))
            if switch is not None and done == RESTORE_AT:
                switch.restore()
            if save is not None and done == recipe.resume_at:
                save_checkpoint(save, model=wrapped, optimizer=optimizer, step=train_step, loader=loader,
                                epoch=epoch, micro_steps=done,
                                **({"tracker": tracker} if tracker is not None else {}))  # fmt: skip
                if switch is not None and switch.active:
                    switch.restore()  # (a preempted process ends here; this one goes on to other tests)
                return _outcome(model, losses)
        if tracker is not None:
            losses.append(tracker.end_epoch())
        dataset.after_epoch(epoch)
    return _outcome(model, losses)


def run_reference(recipe: Recipe) -> Outcome:
    """What :func:`run_speedups` must equal: the hand-written loop, but for a resume of a loader whose
    workers augment (per-sample seeds, which no hand loop has), whose promise is the run that never
    stopped."""
    if recipe.resume_at is not None and recipe.workers:
        return _speedups_part(recipe, None, None)
    return run_plain(recipe)


def _pieces(x: torch.Tensor, y: torch.Tensor, size: int | None) -> Iterator[tuple[torch.Tensor, ...]]:
    rows = len(x)
    size = rows if size is None else size
    for lo in range(0, rows, size):
        yield x[lo : lo + size], y[lo : lo + size], torch.tensor(min(size, rows - lo) / rows)


def run_plain(recipe: Recipe) -> Outcome:
    """The same training by hand: a DataLoader with fresh workers every epoch, autocast, loss / N and a
    step every N (the last window divided by what it holds), row-weighted chunks, clip_grad_norm_, losses
    read with ``.item()``; DDP with ``no_sync()`` but for a window's last chunk, and a ``DistributedSampler``
    with ``set_epoch``."""
    torch.manual_seed(0)
    dataset = Samples(recipe.stateful)
    generator = torch.Generator().manual_seed(0)
    init = rescale if recipe.stateful else None
    sampler = None
    if recipe.ddp or recipe.resume_at is not None:
        world = torch.distributed.get_world_size() if recipe.ddp else 1
        rank = torch.distributed.get_rank() if recipe.ddp else 0
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, BATCH, shuffle=sampler is None, sampler=sampler, num_workers=recipe.workers,
                        generator=generator, worker_init_fn=init)  # fmt: skip
    model = _model(recipe, ours=False)
    if recipe.compile:  # regional compilation by hand: each repeated block on its own
        for block in model.blocks:
            block.compile()
    if recipe.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = _optimizer(recipe, model)
    size = recipe.oom_above if recipe.micro == "auto" else recipe.micro
    losses: list[float] = []
    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = len(loader)
        sums = [0.0, 0]
        for i, (x, y) in enumerate(loader):
            start = i - i % recipe.every
            window = min(recipe.every, batches - start)  # the last window is as long as what is left
            last = i == start + window - 1
            loss = torch.zeros(())
            pieces = list(_pieces(x, y, size if isinstance(size, int) else None))
            for j, (xs, ys, share) in enumerate(pieces):
                synced = not recipe.ddp or (last and j == len(pieces) - 1)  # DDP: the window's last chunk
                with contextlib.nullcontext() if synced else model.no_sync():
                    with torch.autocast("cpu", torch.bfloat16) if recipe.bf16 else contextlib.nullcontext():
                        out = model(xs)
                    piece = F.mse_loss(out.float(), ys)
                    (piece * share / window).backward()
                loss = loss + piece.detach() * share
            if recipe.tracker:
                sums[0] += loss.item() * len(y)
                sums[1] += len(y)
            else:
                losses.append(loss.item())
            if last:
                if recipe.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
                optimizer.step()
                optimizer.zero_grad()
        if recipe.tracker:
            losses.append(sums[0] / sums[1])
        dataset.after_epoch(epoch)
    inner = model.module if recipe.ddp else model
    return _outcome(inner, losses)


def differences(got: Outcome, want: Outcome) -> dict[str, float]:
    """The largest absolute difference of each part (``rng``: 0 when the states are equal, else inf)."""

    def worst(a: list[Any], b: list[Any]) -> float:
        if len(a) != len(b):
            return math.inf
        pairs = zip(a, b, strict=True)
        gaps = (float((torch.as_tensor(x) - torch.as_tensor(y)).abs().max()) for x, y in pairs)
        return max(gaps, default=0.0)

    return {
        "params": worst(got.params, want.params),
        "buffers": worst([b.float() for b in got.buffers], [b.float() for b in want.buffers]),
        "losses": worst(got.losses, want.losses),
        "rng": 0.0 if torch.equal(got.rng, want.rng) else math.inf,
    }

"""Language model: a GPT trained to a validation loss, before and after speedups, by hand, Accelerate, Fabric.

    python -m benchmarks.language_model --reps 3    # under 8 minutes on 2 cores
    python -m benchmarks.language_model --quick     # smoke mode: a tiny model, one repetition
    python -m benchmarks.language_model --device cuda   # the same five loops on a GPU; writes results/gpu.md
    OUT=dir bash benchmarks/gpu_run.sh                  # on a GPU machine: with pytest -m cuda, < 12 min

Results go to ``benchmarks/results/latest.md`` (its ``language_model`` section) and ``language_model.png``,
over the committed ones: set ``SPEEDUPS_BENCH_RESULTS=DIR`` to write them elsewhere.

The task: next-byte prediction on the standard library's own source (``_text.py``: the running Python's
top-level ``*.py`` files, sorted, every tenth file held out for validation), a GPT of 6 identical pre-norm
blocks (width 384, 6 heads 64 wide, context 256: nanoGPT's character-level size without dropout; ``_gpt.py``).
Each loop is timed from its first batch to the first evaluation (every 5 optimizer steps, on 16 fixed
validation windows, at the training batch size) whose loss is at or below the target (2.76 nats per byte):
compiling is inside that time (what a user waits for), and evaluation too. The steady-state step (the
optimizer steps between evaluations after the first, evaluation excluded) is printed apart.

One recipe in every loop: AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1), a linear warm-up of 10 optimizer
steps then a cosine to a tenth over 300, the gradients' total norm clipped to 1.0, 8 sequences per optimizer
step as 2 micro-batches of 4 (accumulation), the same weights (seeded per repetition) and the same order of
windows (one permutation per repetition), no dropout: the loops differ in speed, not in data.

- ``before``: the loop a user writes first: fp32, eager, a plain ``DataLoader``,
  ``losses.append(loss.item())`` every step, accumulation by ``(loss / 2).backward()`` by hand, AdamW as
  constructed by default.
- ``after``: the same loop upgraded as docs/transformer.md teaches, and nothing else: ``fast_loader``
  (``num_workers=0``: a window of a token stream in memory is a slice),
  ``prefetch_to_device`` (CUDA), ``to_device``, ``compile_blocks(model, "blocks.*")``,
  ``mixed_precision()``, ``@accumulate(2, optimizer, scheduler=..., max_grad_norm=1.0)``, ``LossTracker``,
  AdamW with ``fused=True``, and ``fast_kernels`` where it applies (an fp32 step on an NVIDIA GPU: not here).
- ``expert``: the best hand-written PyTorch loop with the same ideas: bf16 autocast, ``torch.compile`` of the
  whole model, fused AdamW, a ``DataLoader`` without workers (pinned on CUDA), the micro-batches' losses
  summed on the device, no sync in the step.
- ``accelerate`` / ``fabric``: the ``after`` loop written with each library as its docs teach: Accelerate's
  ``mixed_precision="bf16"``, ``gradient_accumulation_steps`` and ``TorchDynamoPlugin(backend="inductor",
  use_regional_compilation=True)``; Fabric's ``precision="bf16-mixed"``, ``torch.compile(model)`` before
  ``fabric.setup`` and ``no_backward_sync``. A row that cannot run says why.

Compiling: every compiled loop runs on inductor. One warm-up before the race compiles each way once (cold:
this run points inductor's on-disk cache at an empty folder, unless ``TORCHINDUCTOR_CACHE_DIR`` is set, and
the output prints those cold compiles). Before each race ``torch.compiler.reset()`` drops the compiled code in
memory, so every race traces again and loads from the warm on-disk cache, as every run of a user's after the
first: each repetition then measures the same thing. The rows in bf16 (where ``mixed_precision()`` picks
it) compute in bf16; ``before`` in fp32.

The limit beside it: the run times a large ``torch.matmul`` (4096 x 4096, or 2048 with ``--quick``) in bf16
and in fp32 on this device and thread count, and prints each loop's model FLOPs per second in its steady
state (``6 N + 12 L T d`` per token: PaLM's count, as nanoGPT's ``estimate_mfu``) as a share of the faster of
the two rates: its MFU, how far the loop is from this machine.

``SPEEDUPS_LM_TRACE=1`` prints each evaluation's loss and time as it happens (to choose a target that every
loop crosses at the same evaluation).

Repetitions are interleaved (each runs every row, in a rotated order); every ratio is taken within a
repetition, and its median over repetitions is printed with the range. The last line is

    language_model: speedups X.XXx faster than before, Y.YYx of expert, accelerate A.AAx, fabric F.FFx;
    MFU after M% expert E%

(one line in the output).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # before torch reads it: this run's compiles start cold
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="speedups-lm-inductor-")

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from benchmarks import _peers
from benchmarks._gpt import GPT
from benchmarks._peers import PRECISION, fabric_class, fmt, median, notes, race, shown
from benchmarks._text import Corpus, load_corpus
from benchmarks._timing import RESULTS, save_chart, write_section
from speedups import (
    LossTracker,
    accumulate,
    compile_blocks,
    fast_loader,
    mixed_precision,
    prefetch_to_device,
    resolve_device,
    to_device,
)
from speedups._helpers.hardware import matmul_rate

# the recipe, the same in every row
LR, BETAS, WEIGHT_DECAY, CLIP = 2e-3, (0.9, 0.95), 0.1, 1.0
WARMUP, HORIZON = 10, 300  # optimizer steps: linear warm-up, then a cosine to LR / 10 at HORIZON
MICRO, ACCUM = 4, 2  # sequences per micro-batch, micro-batches per optimizer step
EVAL_EVERY, VAL_WINDOWS = 5, 16


@dataclass(frozen=True)
class Shape:
    """The model's size."""

    depth: int = 6
    width: int = 384
    heads: int = 6
    seq: int = 256

    def model(self, seed: int) -> GPT:
        torch.manual_seed(seed)
        return GPT(self.depth, self.width, self.heads, vocab=256, seq=self.seq)


@dataclass(frozen=True)
class Setup:
    """What every row of one repetition is given."""

    seed: int
    shape: Shape
    device: torch.device
    target: float  # validation loss (nats per byte)
    max_steps: int  # optimizer steps before a row gives up
    dtype: torch.dtype | None  # what mixed_precision() picks here (None: fp32)
    backend: str  # torch.compile's backend for every compiled row


class Order(Sampler[int]):
    """Every row's order of training windows: one permutation per seed, long enough for ``max_steps``."""

    def __init__(self, size: int, seed: int, needed: int) -> None:
        self.size, self.seed, self.needed = size, seed, needed

    def __len__(self) -> int:
        return self.needed

    def __iter__(self) -> Iterator[int]:
        out: list[int] = []
        for rnd in range(math.ceil(self.needed / self.size)):
            g = torch.Generator().manual_seed(self.seed * 1000 + rnd)
            out += torch.randperm(self.size, generator=g).tolist()
        return iter(out[: self.needed])


def schedule(step: int) -> float:
    """The learning rate's factor at optimizer step ``step`` (LambdaLR's)."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / (HORIZON - WARMUP))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def optimizer_for(model: torch.nn.Module, **kwargs: object) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Outcome:
    """One row's race."""

    seconds: float  # to the target (or to max_steps), compiling and evaluation included
    updates: int
    val_loss: float
    reached: bool
    step_s: float  # the steady-state optimizer step (evaluation excluded)
    notes: str = ""


@dataclass
class Race:
    """The clock of one row: evaluation every EVAL_EVERY optimizer steps, stopped at the target."""

    s: Setup
    corpus: Corpus
    began: float = 0.0
    mark: float = 0.0
    intervals: list[float] = field(default_factory=list)  # training seconds between evaluations
    losses: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:  # the validation windows on the device once, before the clock starts
        self.val_x, self.val_y = self.corpus.val_x.to(self.s.device), self.corpus.val_y.to(self.s.device)

    def start(self) -> None:
        _sync(self.s.device)
        self.began = self.mark = time.perf_counter()

    def due(self, updates: int) -> bool:
        return updates % EVAL_EVERY == 0 or updates >= self.s.max_steps

    def done(self, model: torch.nn.Module, updates: int, autocast: object) -> bool:
        """Evaluate (call when :meth:`due`); True when the row stops."""
        _sync(self.s.device)
        now = time.perf_counter()
        self.intervals.append(now - self.mark)
        x, y = self.val_x, self.val_y
        total = torch.zeros((), device=self.s.device)
        with torch.no_grad(), autocast:  # type: ignore[attr-defined]
            for i in range(0, len(x), MICRO):  # the training shape: no recompile for another batch size
                logits = model(x[i : i + MICRO])
                total += F.cross_entropy(
                    logits.flatten(0, 1).float(), y[i : i + MICRO].flatten(), reduction="sum"
                )
        self.losses.append(total.item() / y.numel())
        if os.environ.get("SPEEDUPS_LM_TRACE"):
            print(
                f"  {updates} updates, {time.perf_counter() - self.began:.1f} s: validation loss "
                f"{self.losses[-1]:.4f}",
                flush=True,
            )
        self.updates = updates
        self.stopped = time.perf_counter()
        self.mark = self.stopped
        return self.losses[-1] <= self.s.target or updates >= self.s.max_steps

    def outcome(self, notes: str) -> Outcome:
        steady = self.intervals[1:] or self.intervals
        return Outcome(
            seconds=self.stopped - self.began, updates=self.updates, val_loss=self.losses[-1],
            reached=self.losses[-1] <= self.s.target, step_s=statistics.median(steady) / EVAL_EVERY,
            notes=notes,
        )  # fmt: skip


def _autocast(s: Setup) -> torch.autocast:
    return torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype is not None)


# ------------------------------------------------------------------------------------------------ the rows
def before(corpus: Corpus, s: Setup) -> Outcome:
    race = Race(s, corpus)
    device = s.device
    model = s.shape.model(s.seed).to(device)
    optimizer = optimizer_for(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loader = DataLoader(corpus.train, batch_size=MICRO, sampler=Order(len(corpus.train), s.seed, _needed(s)))
    losses = []
    updates = 0
    race.start()
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        (loss / ACCUM).backward()
        losses.append(loss.item())  # a host-device sync every step on a GPU
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            updates += 1
            if race.due(updates) and race.done(model, updates, torch.autocast(device.type, enabled=False)):
                break
    return race.outcome("fp32, eager, DataLoader(num_workers=0), .item() every step, AdamW (default)")


def after(corpus: Corpus, s: Setup) -> Outcome:
    race = Race(s, corpus)
    model = to_device(s.shape.model(s.seed), s.device)
    optimizer = optimizer_for(model, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    compile_blocks(model, "blocks.*", backend=s.backend)
    amp = mixed_precision(device_type=s.device.type)  # bf16 where the device is fast at it
    # a token stream in memory: a window is a slice, which a worker process could only slow down (its IPC
    # and its wake-ups on the step's cores), as docs/transformer.md says
    loader = fast_loader(
        corpus.train, MICRO, sampler=Order(len(corpus.train), s.seed, _needed(s)), num_workers=0
    )
    batches = prefetch_to_device(loader, s.device) if s.device.type == "cuda" else loader

    @accumulate(ACCUM, optimizer, scheduler=scheduler, max_grad_norm=CLIP)
    @amp
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    tracker = LossTracker()
    race.start()
    for batch in batches:
        x, y = to_device(batch, s.device)
        tracker.update(train_step(x, y))  # no sync
        updates = train_step.num_updates
        if train_step.is_boundary and race.due(updates) and race.done(model, updates, amp):
            break
    return race.outcome(
        f"compile_blocks({s.backend}), {amp!r}, fast_loader(num_workers={loader.num_workers}), "
        f"@accumulate({ACCUM}, max_grad_norm={CLIP}), fused AdamW, train loss {tracker.compute():.3f}"
    )


def _plain_loader(corpus: Corpus, s: Setup) -> DataLoader:
    """The expert's loader for a byte stream in memory: slicing needs no workers; pinned for CUDA."""
    return DataLoader(
        corpus.train, batch_size=MICRO, sampler=Order(len(corpus.train), s.seed, _needed(s)),
        pin_memory=s.device.type == "cuda",
    )  # fmt: skip


def expert(corpus: Corpus, s: Setup) -> Outcome:
    race = Race(s, corpus)
    device, cuda = s.device, s.device.type == "cuda"
    model = s.shape.model(s.seed).to(device)
    optimizer = optimizer_for(model, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    compiled = torch.compile(model, backend=s.backend)
    total = torch.zeros((), device=device)
    updates = 0
    race.start()
    for i, (x, y) in enumerate(_plain_loader(corpus, s)):
        x, y = x.to(device, non_blocking=cuda), y.to(device, non_blocking=cuda)
        with _autocast(s):
            loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        (loss / ACCUM).backward()  # equal micro-batches: exactly the window's mean
        total += loss.detach()
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            if race.due(updates) and race.done(compiled, updates, _autocast(s)):
                break
    return race.outcome(f"torch.compile(model), autocast {s.dtype}, fused AdamW, train loss "
                        f"{total.item() / (i + 1):.3f}")  # fmt: skip




def accelerate_row(corpus: Corpus, s: Setup) -> Outcome:
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    race = Race(s, corpus)
    model = s.shape.model(s.seed)
    optimizer = optimizer_for(model, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    accelerator = Accelerator(
        mixed_precision=PRECISION[s.dtype][0], gradient_accumulation_steps=ACCUM, cpu=s.device.type == "cpu",
        dynamo_plugin=TorchDynamoPlugin(backend=s.backend, use_regional_compilation=True),
    )  # fmt: skip
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, _plain_loader(corpus, s), scheduler
    )
    total = torch.zeros((), device=accelerator.device)
    updates = 0
    race.start()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        total += loss.detach()
        if accelerator.sync_gradients:
            updates += 1
            if race.due(updates) and race.done(model, updates, accelerator.autocast()):
                break
    accelerator.free_memory()
    return race.outcome(f"mixed_precision={PRECISION[s.dtype][0]!r}, regional compilation, "
                        f"accumulate({ACCUM}), "
                        f"train loss {total.item() / (updates * ACCUM):.3f}")  # fmt: skip




def fabric_row(corpus: Corpus, s: Setup) -> Outcome:
    race = Race(s, corpus)
    fabric = fabric_class()(accelerator=s.device.type, devices=1, precision=PRECISION[s.dtype][1])
    fabric.launch()
    model = s.shape.model(s.seed)
    optimizer = optimizer_for(model, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer = fabric.setup(torch.compile(model, backend=s.backend), optimizer)
    loader = fabric.setup_dataloaders(_plain_loader(corpus, s))
    total = torch.zeros((), device=fabric.device)
    updates = 0
    race.start()
    for i, (x, y) in enumerate(loader):
        boundary = (i + 1) % ACCUM == 0
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            fabric.backward(loss / ACCUM)
        total += loss.detach()
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            updates += 1
            if race.due(updates) and race.done(model, updates, fabric.autocast()):
                break
    return race.outcome(f"precision={PRECISION[s.dtype][1]!r}, torch.compile(model), no_backward_sync, "
                        f"train loss {total.item() / (i + 1):.3f}")  # fmt: skip


ROWS: dict[str, Callable[[Corpus, Setup], Outcome]] = {
    "before": before,
    "after": after,
    "expert": expert,
    "accelerate": accelerate_row,
    "fabric": fabric_row,
}


def _needed(s: Setup) -> int:
    return s.max_steps * MICRO * ACCUM




# ----------------------------------------------------------------------------------------------- the warm-up
def _warm_up(corpus: Corpus, s: Setup) -> dict[str, float]:
    """Compile each way once (cold: this run's inductor cache starts empty), and run the eager kernels.

    Returns the seconds of each cold compile (the first training step's time minus a warm step's).
    """
    x, y = corpus.train[0]
    x, y = x.repeat(MICRO, 1).to(s.device), y.repeat(MICRO, 1).to(s.device)
    val = corpus.val_x[:MICRO].to(s.device)
    cold = {}
    for way in ("eager", "blocks", "whole"):
        model = s.shape.model(0).to(s.device)
        if way == "blocks":
            compile_blocks(model, "blocks.*", backend=s.backend)
        forward = torch.compile(model, backend=s.backend) if way == "whole" else model
        times = []
        for dtype in [None, s.dtype] if way == "eager" else [s.dtype]:
            for _ in range(3):
                _sync(s.device)
                start = time.perf_counter()
                with torch.autocast(s.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
                loss.backward()
                _sync(s.device)
                times.append(time.perf_counter() - start)
        with torch.no_grad(), torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype is not None):
            forward(val)  # evaluation's graph too
        if way != "eager":
            cold[way] = times[0] - statistics.median(times[1:])
    return cold


# ------------------------------------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: a tiny model, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3; quick 1)")
    parser.add_argument(
        "--target", type=float, default=None, help="validation loss (default 2.76; quick 3.2)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="give up after (default 150; quick 40)")
    parser.add_argument("--threads", type=int, default=None, help="torch compute threads (default: the CPUs)")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: this process's device)")
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile's backend (smoke test: aot_eager)"
    )
    parser.add_argument(
        "--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="a subset of the rows"
    )
    args = parser.parse_args(argv)
    for flag, value in (("--reps", args.reps), ("--max-steps", args.max_steps), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: expected an int >= 1 (or leave it out for the default)")
    if args.target is not None and not args.target > 0:
        parser.error(f"--target {args.target}: expected a validation loss > 0 (nats per byte; ln 256 = 5.55)")
    reps = args.reps or (1 if args.quick else 3)
    target = args.target or (3.2 if args.quick else 2.76)
    max_steps = args.max_steps or (40 if args.quick else 150)
    shape = Shape(depth=2, width=64, heads=2, seq=64) if args.quick else Shape()

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or cpus
    torch.set_num_threads(threads)
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as err:
        parser.error(f"--device {args.device}: {err}")
    with warnings.catch_warnings():  # the after row warns itself if mixed_precision() stays in fp32 here
        warnings.simplefilter("ignore")
        dtype = mixed_precision(device_type=device.type).dtype
    corpus = load_corpus(shape.seq, VAL_WINDOWS)
    setup = Setup(seed=0, shape=shape, device=device, target=target, max_steps=max_steps, dtype=dtype,
                  backend=args.backend)  # fmt: skip
    n = 2048 if args.quick else 4096
    rates = {
        name: matmul_rate(device, dt, n) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    }
    peak_name = max(rates, key=rates.__getitem__)
    cold = _warm_up(corpus, setup)
    flops_per_step = shape.model(0).flops_per_token() * shape.seq * MICRO * ACCUM

    done, skipped = race(
        lambda name, rep: ROWS[name](corpus, replace(setup, seed=rep)),
        [n for n in ROWS if n in args.rows], reps, threads,
        before_each=torch.compiler.reset,  # each race compiles as a new process would, from the warm cache
    )  # fmt: skip

    def paired(num: str, den: str) -> list[float] | None:
        return _peers.paired(done, num, den)



    def mfu(name: str) -> float:
        return flops_per_step / statistics.median(o.step_s for o in done[name]) / rates[peak_name]

    precision = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]
    out = [
        f"language_model: next-byte GPT ({shape.depth} blocks, width {shape.width}, {shape.heads} heads, "
        f"context {shape.seq}) on {corpus.files} standard-library files of Python "
        f"{platform.python_version()} "
        f"({corpus.train_bytes / 1e6:.1f} MB train, {corpus.val_bytes / 1e6:.2f} MB validation), each loop "
        f"timed to validation loss <= {target} (compiling included)",
        f"{device}, {threads} compute thread(s), torch {torch.__version__}; every row: AdamW lr {LR:g}, "
        f"{MICRO * ACCUM} sequences per optimizer step ({MICRO} x {ACCUM}), clip {CLIP}; {precision} except "
        f"before; {reps} interleaved repetition(s): medians, and the ratios' median (lowest-highest)",
        f"machine: matmul {n}x{n} bf16 {rates['bf16'] / 1e9:.0f} GFLOP/s, fp32 {rates['fp32'] / 1e9:.0f} "
        f"GFLOP/s; MFU is the share of the {peak_name} rate; model {flops_per_step / 1e9:.1f} GFLOP per "
        f"optimizer step; cold compile (once, before the race): blocks {cold['blocks']:.1f} s, whole model "
        f"{cold['whole']:.1f} s",
        f"{'row':<11} {'to target':>10} {'steps':>6} {'step (steady)':>14} {'MFU':>6} {'vs before':>18} "
        f"{'vs expert':>18}",
    ]
    for name, runs in done.items():
        missed = sum(not o.reached for o in runs)
        seconds = statistics.median(o.seconds for o in runs)
        steps = statistics.median(o.updates for o in runs)
        step_ms = 1e3 * statistics.median(o.step_s for o in runs)
        out.append(
            f"{name:<11} {seconds:>8.1f} s{'*' if missed else ' '}{steps:>6g} {step_ms:>11.0f} ms "
            f"{100 * mfu(name):>5.1f}% {shown(paired('before', name)):>18} "
            f"{shown(paired(name, 'expert')):>18}"
        )
    out += notes(
        done, skipped, lambda runs: "final validation loss " + ", ".join(f"{o.val_loss:.3f}" for o in runs),
        f"{max_steps} optimizer steps",
    )  # fmt: skip
    speedups_ = {n: r for n in done if (r := median(paired("before", n))) is not None}
    if speedups_ and device.type == "cpu":
        chart = save_chart(
            RESULTS / "language_model.png",
            "language model: speedup over before",
            speedups_,
            ylabel="x faster",
        )
        out.append(f"chart: {chart}")

    def vs_before(name: str) -> str:
        return fmt(median(paired("before", name)))

    def mfu_of(name: str) -> str:
        return f"{100 * mfu(name):.0f}%" if name in done else "n/a"

    out.append(
        f"language_model: speedups {vs_before('after')} faster than before, "
        f"{fmt(median(paired('after', 'expert')))} of expert, accelerate {vs_before('accelerate')}, "
        f"fabric {vs_before('fabric')}; MFU after {mfu_of('after')} expert {mfu_of('expert')}"
    )
    text = "\n".join(out)
    print(text, flush=True)
    if device.type == "cuda":
        _write_gpu_results(device, text)
    else:
        write_section("language_model", text)
    return speedups_


def _write_gpu_results(device: torch.device, text: str) -> Path:
    """``RESULTS/gpu.md``: the device, torch and CUDA versions, the date, and the table with its line."""
    path = RESULTS / "gpu.md"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# language_model on a GPU\n\n{torch.cuda.get_device_name(device)}; torch {torch.__version__}; "
        f"CUDA {torch.version.cuda}; {stamp}\n\n```\n{text.strip()}\n```\n"
    )
    print(f"results: {path}")
    return path


if __name__ == "__main__":
    main()

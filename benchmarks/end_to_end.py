"""End to end: the article's loop before and after speedups, by hand, with Accelerate and Fabric, in one run.

    python -m benchmarks.end_to_end            # about 6 minutes: 7 interleaved repetitions to 0.95 accuracy
    python -m benchmarks.end_to_end --quick    # smoke mode (well under a minute on 2 cores)

One real task, five loops, each timed from its first batch to the epoch whose test accuracy reaches the target
(evaluation included; set-up such as ``tune_loader``'s timing or wrapping by a library is reported, not
timed). The task: scikit-learn's digits stored as 64x64 PNGs, decoded and augmented per item on the CPU in
``__getitem__`` (random resized crop to 32x32, random affine, normalise: about as much CPU per item as the
training step spends per sample; the output's second line gives both), a CNN with a 512-wide head
(``_digits32.py``).

- ``before``: the article's starting loop: ``DataLoader(batch_size=32)`` with ``num_workers=0``, ``.to()``
  per tensor, fp32, ``losses.append(loss.item())`` every step.
- ``after``: the same loop upgraded as the README and docs teach: ``fast_loader`` + ``tune_loader`` (timed with the
  training step, ``step=``), ``to_device``,
  ``LossTracker``, ``mixed_precision("auto")``, ``find_batch_size`` + ``accumulation_plan`` + ``@accumulate``
  for the recipe's batch (one micro-batch where it fits, as here; ``--max-micro-batch 16`` splits it).
- ``expert``: the best plain-PyTorch loop with the same ideas (the limit to approach): workers, pinned
  memory and ``non_blocking`` on CUDA, autocast, hand-written accumulation, the loss summed on the device.
- ``accelerate`` / ``fabric``: the ``after`` loop written idiomatically with each library
  (``Accelerator(mixed_precision=..., gradient_accumulation_steps=...)`` + ``accumulate()``;
  ``Fabric(precision=...)`` + ``setup_dataloaders`` + ``no_backward_sync``). A row that cannot run says why.

Every row trains the same recipe (Adam, lr 1e-3, 32 samples per optimizer step) on the same data stream: one
``RaceSampler`` order per repetition, whose keys also seed each item's augmentation, so every row sees the
same batches augmented alike whatever its workers (rows in the same precision need the same epochs) and the
race measures speed, not luck. All rows start from the same weights (same seed per repetition) and use the
same compute thread count (``--threads``, default 1, like the other benchmarks); *expert* and the peers give
their loader one worker per CPU, *after* what ``tune_loader`` measured. Set-up (``find_batch_size``'s
probes, ``tune_loader``'s timing: about 5 s for *after*, paid once per run) is printed in its own column and
is not in the time to target.

Repetitions are interleaved (each runs every row, in a rotated order). Every ratio is taken within a
repetition, and the median over repetitions is printed with its range: a shared machine that gets busier or
quieter between repetitions moves both sides of a ratio alike, and the range shows the noise left. So a
ratio is not the quotient of two medians of the time column. The last line is

    end_to_end: speedups X.XXx faster than before, Y.YYx of expert, accelerate A.AAx, fabric F.FFx

X, A and F: the median of before's time to target over theirs. Y: the median of after's over expert's
(1.00: as fast as *expert*, the hand-written limit; below 1.00: within noise of it, or ahead).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks import _peers
from benchmarks._digits32 import (
    SIZE,
    STORED,
    Outcome,
    Race,
    RaceSampler,
    Task,
    accuracy,
    load_task,
    make_model,
)
from benchmarks._peers import PRECISION, fabric_class, fmt, median, notes, race, shown
from benchmarks._timing import RESULTS, save_chart, write_section
from speedups import (
    LossTracker,
    accumulate,
    accumulation_plan,
    fast_loader,
    find_batch_size,
    mixed_precision,
    resolve_device,
    to_device,
    tune_loader,
)

BATCH, LR = 32, 1e-3  # the recipe (samples per optimizer step, Adam's learning rate), the same in every row


@dataclass(frozen=True)
class Setup:
    """What every row of one repetition is given."""

    seed: int
    batch: int  # samples per optimizer step (every row)
    device: torch.device
    target: float
    max_epochs: int
    max_micro: int  # the largest micro-batch find_batch_size may try (the CPU has no OOM to stop it)
    micro: int  # expert's and peers' micro-batch: what find_batch_size finds for this model (the cap)
    accum: int  # batch // micro
    dtype: torch.dtype | None  # what mixed_precision("auto") picks here (None: fp32)
    workers: int  # expert's and peers' num_workers: the CPUs this process may use
    tune_seconds: float


# ------------------------------------------------------------------------------------------------ the rows
def before(task: Task, s: Setup) -> Outcome:
    race = Race(s.target, s.max_epochs)
    torch.manual_seed(s.seed)
    model = make_model().to(s.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    sampler = task.sampler(s.seed)  # the race's order (every row's); the article's loop has shuffle=True
    loader = DataLoader(task.train, batch_size=s.batch, sampler=sampler)
    race.start()
    while True:
        sampler.set_epoch(race.epochs)
        losses = []
        for x, y in loader:
            x, y = x.to(s.device), y.to(s.device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # a host-device sync every step on a GPU
        if race.epoch_done(accuracy(model, task, s.device)):
            return race.outcome(f"batch {s.batch}, num_workers=0, fp32")


def after(task: Task, s: Setup) -> Outcome:
    race = Race(s.target, s.max_epochs)
    torch.manual_seed(s.seed)
    device = s.device
    model = to_device(make_model(), device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    amp = mixed_precision("auto", device_type=device.type)  # bf16 where the device is fast at it

    def probe(batch_size: int) -> None:  # one whole training step at this size; find_batch_size undoes it
        x = torch.randn(batch_size, 1, SIZE, SIZE, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        with amp:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    largest = find_batch_size(probe, model, optimizer, start=16, max_size=s.max_micro)
    plan = accumulation_plan(s.batch, largest, world_size=1)  # the recipe's batch, in micro-batches that fit
    sampler = task.sampler(s.seed)
    loader = fast_loader(task.train, plan.micro_batch_size, sampler=sampler)
    # Tuning times each worker setting with the training step's forward and backward running here (on a
    # copy of the model, without the update, as docs/tips/tune-loader.md teaches: it trains nothing), so the
    # workers are judged against the cores the step needs.
    spare_model = copy.deepcopy(model)

    def tuning_step(batch: list[torch.Tensor]) -> None:
        x, y = to_device(batch, device)
        with amp:
            loss = F.cross_entropy(spare_model(x), y)
        loss.backward()

    loader, report = tune_loader(loader, max_seconds=s.tune_seconds, progress=False, step=tuning_step)

    @accumulate(plan.accumulation_steps, optimizer)
    @amp
    def train_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        return F.cross_entropy(model(x), y), len(y)

    tracker = LossTracker()
    race.start()
    while True:
        sampler.set_epoch(race.epochs)
        for batch in train_step.epoch(loader):  # flushes the short last window
            x, y = to_device(batch, device)
            loss, n = train_step(x, y)
            tracker.update(loss, n)  # no sync
        tracker.end_epoch()  # one sync per epoch
        if race.epoch_done(accuracy(model, task, device, amp)):
            chosen = ", ".join(f"{k}={v}" for k, v in report.chosen.items())
            return race.outcome(
                f"find_batch_size -> {largest} (max_size={s.max_micro}), micro-batch {plan.micro_batch_size} "
                f"x @accumulate({plan.accumulation_steps}); tune_loader: {chosen}; {amp!r}"
            )


def _plain_loader(task: Task, s: Setup, sampler: RaceSampler) -> DataLoader:
    """The loader an expert writes by hand: workers on every CPU, persistent, pinned for CUDA."""
    return DataLoader(
        task.train,
        batch_size=s.micro,
        sampler=sampler,
        num_workers=s.workers,
        persistent_workers=s.workers > 0,
        pin_memory=s.device.type == "cuda",
    )


def expert(task: Task, s: Setup) -> Outcome:
    race = Race(s.target, s.max_epochs)
    torch.manual_seed(s.seed)
    device, cuda, dtype = s.device, s.device.type == "cuda", s.dtype
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    sampler = task.sampler(s.seed)
    loader = _plain_loader(task, s, sampler)
    n_items, steps = len(task.train), len(loader)
    race.start()
    while True:
        sampler.set_epoch(race.epochs)
        total = torch.zeros((), device=device)  # the epoch's loss sum, read once
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=cuda), y.to(device, non_blocking=cuda)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y, reduction="sum")
            window_items = min(s.batch, n_items - i // s.accum * s.batch)
            scaler.scale(loss / window_items).backward()  # exactly the window's mean, short window too
            total += loss.detach()
            if (i + 1) % s.accum == 0 or i + 1 == steps:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
        epoch_loss = total.item() / n_items  # one sync per epoch
        if race.epoch_done(accuracy(model, task, device, autocast)):
            return race.outcome(
                f"micro-batch {s.micro} x {s.accum}, num_workers={s.workers}, loss {epoch_loss:.3f}"
            )




def accelerate_row(task: Task, s: Setup) -> Outcome:
    from accelerate import Accelerator

    race = Race(s.target, s.max_epochs)
    torch.manual_seed(s.seed)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    accelerator = Accelerator(
        mixed_precision=PRECISION[s.dtype][0],
        gradient_accumulation_steps=s.accum,
        cpu=s.device.type == "cpu",
    )
    sampler = task.sampler(s.seed)
    model, optimizer, loader = accelerator.prepare(model, optimizer, _plain_loader(task, s, sampler))
    race.start()
    while True:
        sampler.set_epoch(race.epochs)
        total = torch.zeros((), device=accelerator.device)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach() * len(y)
        epoch_loss = total.item() / len(task.train)  # one sync per epoch, as expert's
        if race.epoch_done(accuracy(model, task, accelerator.device, accelerator.autocast())):
            accelerator.free_memory()
            return race.outcome(
                f"mixed_precision={PRECISION[s.dtype][0]!r}, accumulate({s.accum}), loss {epoch_loss:.3f}"
            )




def fabric_row(task: Task, s: Setup) -> Outcome:
    race = Race(s.target, s.max_epochs)
    fabric = fabric_class()(accelerator=s.device.type, devices=1, precision=PRECISION[s.dtype][1])
    fabric.launch()
    torch.manual_seed(s.seed)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    sampler = task.sampler(s.seed)
    loader = fabric.setup_dataloaders(_plain_loader(task, s, sampler))
    steps = len(loader)
    race.start()
    while True:
        sampler.set_epoch(race.epochs)
        total = torch.zeros((), device=fabric.device)
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % s.accum == 0 or i + 1 == steps
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / s.accum)
            if boundary:
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach() * len(y)
        epoch_loss = total.item() / len(task.train)  # one sync per epoch, as expert's
        if race.epoch_done(accuracy(model, task, fabric.device, fabric.autocast())):
            return race.outcome(
                f"precision={PRECISION[s.dtype][1]!r}, no_backward_sync, accumulate {s.accum}, "
                f"loss {epoch_loss:.3f}"
            )


ROWS: dict[str, Callable[[Task, Setup], Outcome]] = {
    "before": before,
    "after": after,
    "expert": expert,
    "accelerate": accelerate_row,
    "fabric": fabric_row,
}




def _warm_up(task: Task, s: Setup) -> tuple[float, float]:
    """Run each precision's kernels once, so that no row pays the first call's set-up.

    Returns the balance of the task, in ms: loading one item in this process, and one fp32 training step
    (forward, backward, Adam) per sample at the recipe's batch, both the median of a few timings.
    """
    torch.manual_seed(s.seed)
    model = make_model().to(s.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loads = []
    for i in range(3 * s.batch):
        start = time.perf_counter()
        task.train[i]
        loads.append(time.perf_counter() - start)
    x = torch.stack([task.train[i][0] for i in range(s.batch)]).to(s.device)
    y = task.train.labels[: s.batch].to(s.device)
    steps = []
    for dtype in {None, s.dtype}:
        for _ in range(2):
            with torch.autocast(s.device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(x).float().logsumexp(1).mean()
            loss.backward()
    for _ in range(5):
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        steps.append(time.perf_counter() - start)
    return 1e3 * statistics.median(loads), 1e3 * statistics.median(steps) / s.batch


# ------------------------------------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke mode: one repetition to a low target")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 7; quick 1)")
    parser.add_argument("--target", type=float, default=None, help="test accuracy (default 0.95; quick 0.7)")
    parser.add_argument("--max-epochs", type=int, default=None, help="give up after (default 30; quick 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads, every row (default 1)")
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: this process's device)")
    parser.add_argument("--batch-size", type=int, default=BATCH, help=f"samples per optimizer step ({BATCH})")
    parser.add_argument("--max-micro-batch", type=int, default=None, help="find_batch_size's max_size "
                        "(default: the batch size; smaller makes @accumulate split the batch)")  # fmt: skip
    parser.add_argument(
        "--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="a subset of the rows"
    )
    args = parser.parse_args(argv)
    reps = args.reps or (1 if args.quick else 7)
    target = args.target or (0.7 if args.quick else 0.95)
    max_epochs = args.max_epochs or (4 if args.quick else 30)

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    with warnings.catch_warnings():  # the after row warns itself if "auto" stays in fp32 here
        warnings.simplefilter("ignore")
        dtype = mixed_precision("auto", device_type=device.type).dtype
    max_micro = args.max_micro_batch or args.batch_size
    plan = accumulation_plan(args.batch_size, max_micro, world_size=1)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    task = load_task()
    setup = Setup(
        seed=0, batch=args.batch_size, device=device, target=target, max_epochs=max_epochs,
        max_micro=max_micro, micro=plan.micro_batch_size, accum=plan.accumulation_steps, dtype=dtype,
        workers=cpus, tune_seconds=0.5 if args.quick else 5.0,
    )  # fmt: skip
    load_ms, step_ms = _warm_up(task, setup)

    done, skipped = race(
        lambda name, rep: ROWS[name](task, replace(setup, seed=rep)),
        [n for n in ROWS if n in args.rows], reps, args.threads,
    )  # fmt: skip

    seconds = {n: statistics.median(o.seconds for o in r) for n, r in done.items()}

    def paired(num: str, den: str) -> list[float] | None:
        return _peers.paired(done, num, den)


    precision = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[dtype]
    out = [
        f"end_to_end: digits as {STORED}x{STORED} PNGs, decoded and augmented to {SIZE}x{SIZE} on the CPU in "
        f"__getitem__ ({len(task.train)} train / {len(task.test_y)} test), each loop timed to test accuracy "
        f">= {target}",
        f"balance: loading {load_ms:.2f} ms per item in the main process; the fp32 training step "
        f"{step_ms:.2f} ms per sample at batch {args.batch_size} ({args.threads} thread(s))",
        f"{device}, {args.threads} compute thread(s), {cpus} CPU(s) for loader workers; every row: Adam lr "
        f"{LR:g}, {args.batch_size} samples per optimizer step (micro-batch {plan.micro_batch_size} x "
        f"{plan.accumulation_steps} except before); {precision} except before; {reps} interleaved "
        f"repetition(s): medians, and the ratios' median (lowest-highest) over the repetitions, each "
        f"paired within one",
        f"{'row':<11} {'to target':>10} {'epochs':>7} {'s/epoch':>8} {'vs before':>20} {'vs expert':>20} "
        f"{'set-up (untimed)':>17}",
    ]

    for name, runs in done.items():
        missed = sum(not o.reached for o in runs)
        epochs = statistics.median(o.epochs for o in runs)
        per_epoch = statistics.median(o.seconds / o.epochs for o in runs)
        setup_s = statistics.median(o.setup for o in runs)
        out.append(
            f"{name:<11} {seconds[name]:>8.2f} s{'*' if missed else ' '}{epochs:>6g} {per_epoch:>8.3f} "
            f"{shown(paired('before', name)):>20} {shown(paired(name, 'expert')):>20} {setup_s:>15.2f} s"
        )
    out += notes(
        done, skipped, lambda runs: "final accuracy " + ", ".join(f"{o.accuracy:.3f}" for o in runs),
        f"{max_epochs} epochs",
    )  # fmt: skip
    speedups_ = {n: r for n in done if (r := median(paired("before", n))) is not None}
    if speedups_:
        chart = save_chart(
            RESULTS / "end_to_end.png", "end to end: speedup over before", speedups_, ylabel="x faster"
        )
        out.append(f"chart: {chart}")

    def vs_before(name: str) -> float | None:
        return median(paired("before", name))

    y = median(paired("after", "expert"))
    out.append(
        f"end_to_end: speedups {fmt(vs_before('after'))} faster than before, {fmt(y)} of expert, "
        f"accelerate {fmt(vs_before('accelerate'))}, fabric {fmt(vs_before('fabric'))}"
    )
    text = "\n".join(out)
    print(text, flush=True)
    write_section("end_to_end", text)
    return speedups_


if __name__ == "__main__":
    main()

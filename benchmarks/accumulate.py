"""Benchmark: what ``@accumulate`` costs per micro-step against the hand-written accumulation loop.

A tiny MLP (64-64-10), micro-batches of 32, one CPU thread, accumulation over 4 micro-batches: the time per
epoch of a few hundred micro-steps is dominated by per-step overhead, which is what a wrapper adds. Variants,
timed round-robin in the same run: the hand-written loop, the same loop with ``@accumulate`` (also with an
``on_update`` hook, with preemption watching (``StopOnSignal.requested()`` per call) and with a
``RunDirectory.after_step()`` per call), and, when they are installed, Accelerate's ``accumulate`` and
Lightning Fabric's ``no_backward_sync``.

    python -m benchmarks.accumulate            # about a minute
    python -m benchmarks.accumulate --quick    # a few seconds, for the smoke test
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, installed_peers, ratio_table, save_chart, tiny_mlp_run
from speedups.accumulation import UpdateRecord, accumulate
from speedups.checkpoint import RunDirectory, StopOnSignal

EVERY = 4


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def hand_written(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    model, opt = _setup()

    def epoch() -> None:
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y) / EVERY
            loss.backward()
            if (i + 1) % EVERY == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return epoch


def with_accumulate(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    skip_nonfinite: bool = False,
    hook: bool = False,
    watch: str = "",
) -> Callable[[], None]:
    """``watch``: "stop" calls ``StopOnSignal.requested()`` after every micro-step (preemption watching),
    "run" calls ``RunDirectory.after_step()`` (which also checks whether a periodic save is due)."""
    model, opt = _setup()

    @accumulate(EVERY, opt, skip_nonfinite=skip_nonfinite)
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    if hook:  # what a loop that logs per update registers: it keeps the latest record, reading nothing
        latest: list[UpdateRecord] = []

        def keep(record: UpdateRecord) -> None:
            latest[:] = [record]

        train_step.on_update(keep)

    if watch == "stop":
        stop = StopOnSignal()

        def watched() -> None:
            for x, y in batches:
                train_step(x, y)
                if stop.requested():
                    break

        return watched
    if watch == "run":
        run = RunDirectory(tempfile.mkdtemp(), every_updates=10**9)  # checks every call, never saves here
        run.resume(model=model, optimizer=opt, step=train_step)

        def with_run() -> None:
            for x, y in batches:
                train_step(x, y)
                run.after_step()

        return with_run

    def epoch() -> None:
        for x, y in batches:
            train_step(x, y)

    return epoch


def per_call_seconds(call: Callable[[], object], calls: int = 200_000) -> float:
    """The median time of one ``call()`` over 5 timed runs of ``calls`` calls (a micro-benchmark: the loop's
    own noise, several percent on a shared machine, hides a cost this small)."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs)


def watching_line(micro_step_s: float, seconds: dict[str, float]) -> str:
    """What preemption watching adds to an ``@accumulate`` micro-step: each call timed alone, as a ratio to
    the micro-step, and the loop-level ratios of this run (which this machine's noise dominates)."""
    model, opt = _setup()
    step = accumulate(EVERY, opt)(lambda: model(torch.ones(1, 64)).sum())
    stop = StopOnSignal()
    run = RunDirectory(tempfile.mkdtemp(), every_updates=10**9)  # watching SIGTERM/SIGUSR1 too
    run.resume(model=model, optimizer=opt, step=step)
    requested, after = per_call_seconds(stop.requested), per_call_seconds(run.after_step)
    stop.close()
    run.close()
    alone = seconds["@accumulate"]
    return (
        f"preemption watching: StopOnSignal.requested() {requested * 1e6:.2f} us per call, "
        f"{1 + requested / micro_step_s:.4f}x of a {micro_step_s * 1e3:.3f} ms @accumulate micro-step; "
        f"RunDirectory.after_step() {after * 1e6:.2f} us, {1 + after / micro_step_s:.4f}x "
        f"(in the loop this run: {seconds['@accumulate + StopOnSignal watching'] / alone:.3f}x and "
        f"{seconds['@accumulate + RunDirectory.after_step'] / alone:.3f}x, within its noise)"
    )


def with_accelerate(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    from accelerate import Accelerator

    model, opt = _setup()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=EVERY)
    model, opt = accelerator.prepare(model, opt)

    def epoch() -> None:
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()

    return epoch


def with_fabric(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    from lightning_fabric import Fabric  # the `lightning-fabric` package (also inside `lightning`)

    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = _setup()
    model, opt = fabric.setup(model, opt)

    def epoch() -> None:
        for i, (x, y) in enumerate(batches):
            boundary = (i + 1) % EVERY == 0
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(F.cross_entropy(model(x), y) / EVERY)
            if boundary:
                opt.step()
                opt.zero_grad()

    return epoch


def main(argv: list[str] | None = None) -> dict[str, float]:
    steps, rounds, batches, quick = tiny_mlp_run(argv, __doc__ or "", 400, "micro-steps")
    variants = {
        "hand-written": hand_written(batches),
        "@accumulate": with_accumulate(batches),
        "@accumulate(skip_nonfinite=True)": with_accumulate(batches, skip_nonfinite=True),
        "@accumulate + on_update hook": with_accumulate(batches, hook=True),
        "@accumulate + StopOnSignal watching": with_accumulate(batches, watch="stop"),
        "@accumulate + RunDirectory.after_step": with_accumulate(batches, watch="run"),
    }
    found, skipped = installed_peers(
        [("accelerate", "accelerate", with_accelerate), ("fabric", "lightning_fabric", with_fabric)]
    )
    variants.update((name, make(batches)) for name, make in found)

    seconds = compare(variants, rounds=rounds, warmup=1)
    title = (
        f"accumulate({EVERY}): MLP 64-64-10, batch 32, {steps} micro-steps per epoch, 1 thread, "
        f"median of {rounds} rounds"
    )
    print(ratio_table(title, seconds, "hand-written"))
    if skipped:
        print("skipped: " + ", ".join(skipped))
    ratios = {name: s / seconds["hand-written"] for name, s in seconds.items()}
    print(watching_line(seconds["@accumulate"] / steps, seconds))
    if not quick:
        print(f"chart: {save_chart(RESULTS / 'accumulate.png', title.split(':')[0], ratios)}")
    return ratios


if __name__ == "__main__":
    main()

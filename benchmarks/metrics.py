"""Benchmark: what logging five metrics every step costs, with ``MetricLogger`` and with the peers' loggers.

A tiny MLP (64-64-10), batches of 32, SGD, one CPU thread: a step of about a hundred microseconds, so what
a logger adds per call shows. Every variant computes the same five values each step (loss, accuracy and the
largest logit as tensors, the learning rate and the samples seen as numbers); the baseline does not log
them. Variants, timed round-robin in the same run, each writing a CSV file:

- ``MetricLogger``: ``logger.log(step, loss=loss, acc=acc, ...)`` with the tensors as they are;
- Accelerate (when installed): ``accelerator.log({...: loss.item(), ...}, step)`` to a CSV ``GeneralTracker``
  (Accelerate takes Python numbers only, so the port reads each tensor itself);
- Lightning Fabric (when installed): ``fabric.log_dict({...}, step)`` to its ``CSVLogger`` (which reads each
  tensor with ``.item()``).

It then counts, for one pass of each, the reads of tensor values that would each be a host-device sync on a
GPU: CPU tensors stand in for device tensors (``MetricLogger`` is told not to treat CPU reads as free), and
a ``TorchFunctionMode`` counts ``.item()``, ``.tolist()``, ``float()`` and the like.

    python -m benchmarks.metrics            # about a minute
    python -m benchmarks.metrics --quick    # a few seconds, for the smoke test
"""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from benchmarks._timing import RESULTS, compare, installed_peers, ratio_table, save_chart, tiny_mlp_run
from speedups.metrics import MetricLogger
from speedups.metrics import logger as logger_module

Batches = list[tuple[torch.Tensor, torch.Tensor]]
LR = 0.01


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def _steps(batches: Batches) -> Iterator[tuple[int, dict[str, Any]]]:
    """Train one pass, yielding each step's five values (tensors as the loop has them, numbers as numbers)."""
    model, opt = _setup()
    for step, (x, y) in enumerate(batches):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            acc = (logits.argmax(1) == y).float().mean()
            top = logits.abs().max()
        yield (
            step,
            {"loss": loss.detach(), "acc": acc, "max_logit": top, "lr": LR, "samples": 32 * (step + 1)},
        )


def no_logging(batches: Batches, folder: Path) -> Callable[[], None]:
    def epoch() -> None:
        for _ in _steps(batches):
            pass

    return epoch


def hand_written_csv(batches: Batches, folder: Path) -> Callable[[], None]:
    """The floor any CSV logger pays: ``.item()`` each tensor and write the row with ``csv.writer``."""
    runs = iter(range(10**9))

    def epoch() -> None:
        with open(folder / f"hand{next(runs)}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss", "acc", "max_logit", "lr", "samples"])
            for step, v in _steps(batches):
                writer.writerow(
                    [step, v["loss"].item(), v["acc"].item(), v["max_logit"].item(), v["lr"], v["samples"]]
                )

    return epoch


def with_metric_logger(batches: Batches, folder: Path) -> Callable[[], None]:
    runs = iter(range(10**9))

    def epoch() -> None:
        with MetricLogger(folder / f"speedups{next(runs)}", sinks="csv") as logger:
            for step, values in _steps(batches):
                logger.log(step, **values)

    return epoch


class _CsvTracker:
    """An Accelerate ``GeneralTracker`` that writes rows of Python numbers to a CSV file."""

    name = "csv"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: Any = None
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        return self.writer

    def start(self) -> None:  # accelerate >= 1.3 calls it from init_trackers
        pass

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if self.writer is None:
            self.file = open(self.path, "w", newline="")  # noqa: SIM115 (closed in finish)
            self.writer = csv.DictWriter(self.file, fieldnames=["step", *values])
            self.writer.writeheader()
        self.writer.writerow({"step": step, **values})

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = self.writer = None


def with_accelerate(batches: Batches, folder: Path) -> Callable[[], None]:
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker

    tracker_type = type("CsvTracker", (_CsvTracker, GeneralTracker), {})
    runs = iter(range(10**9))
    accelerator = Accelerator(cpu=True)

    def epoch() -> None:
        tracker = tracker_type(folder / f"accelerate{next(runs)}.csv")
        accelerator.log_with = [tracker]
        accelerator.trackers = [tracker]
        for step, values in _steps(batches):
            accelerator.log(
                {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}, step
            )
        tracker.finish()

    return epoch


def with_fabric(batches: Batches, folder: Path) -> Callable[[], None]:
    from lightning_fabric import Fabric  # the `lightning-fabric` package (also inside `lightning`)
    from lightning_fabric.loggers import CSVLogger

    runs = iter(range(10**9))

    def epoch() -> None:
        fabric = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(folder, name=f"fabric{next(runs)}"))
        for step, values in _steps(batches):
            fabric.log_dict(values, step)
        for logger in fabric.loggers:
            logger.finalize("success")

    return epoch


class _ReadCounter(TorchFunctionMode):
    """Count reads of tensor values into Python (each a host-device sync were the tensor on a GPU)."""

    READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS and args and isinstance(args[0], torch.Tensor):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _device_standin() -> Iterator[None]:
    """Make ``MetricLogger`` treat CPU tensors as it treats GPU tensors (staged, read at a flush)."""
    free = logger_module._CPU_READS_ARE_FREE
    logger_module._CPU_READS_ARE_FREE = False
    try:
        yield
    finally:
        logger_module._CPU_READS_ARE_FREE = free


def reads_per_call(
    make: Callable[[Batches, Path], Callable[[], None]], batches: Batches, folder: Path
) -> float:
    """Reads of tensor values per logged step, beyond what the loop without logging reads (none)."""
    epoch = make(batches, folder)
    with _device_standin(), _ReadCounter() as counter:
        epoch()
    return counter.count / len(batches)


def main(argv: list[str] | None = None) -> dict[str, float]:
    steps, rounds, batches, quick = tiny_mlp_run(argv, __doc__ or "", 500, "logged steps", rounds=21)
    makers: dict[str, Callable[[Batches, Path], Callable[[], None]]] = {
        "no logging": no_logging,
        "hand-written csv.writer + .item()": hand_written_csv,
        "MetricLogger": with_metric_logger,
    }
    found, skipped = installed_peers(
        [
            ("accelerate (accelerator.log)", "accelerate", with_accelerate),
            ("fabric (fabric.log_dict)", "lightning_fabric", with_fabric),
        ]
    )
    makers.update(found)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        seconds = compare({name: make(batches, folder) for name, make in makers.items()}, rounds=rounds)
        reads = {name: reads_per_call(make, batches, folder) for name, make in makers.items()}
    title = (
        f"metrics: five metrics logged every step to CSV, MLP 64-64-10, batch 32, {steps} steps per pass, "
        f"1 thread, median of {rounds} rounds"
    )
    print(ratio_table(title, seconds, "no logging"))
    base = seconds["no logging"]
    width = max(map(len, seconds))
    print(f"\n{'variant':<{width}}  per log call  reads per call (syncs on a GPU)")
    for name, value in seconds.items():
        if name != "no logging":
            print(f"{name:<{width}}  {(value - base) / steps * 1e6:>9.2f} us  {reads[name]:>10.2f}")
    if skipped:
        print("skipped: " + ", ".join(skipped))
    ratios = {name: s / base for name, s in seconds.items()}
    if not quick:
        print(f"chart: {save_chart(RESULTS / 'metrics.png', title.split(':')[0], ratios)}")
    return ratios


if __name__ == "__main__":
    main()

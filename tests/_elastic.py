"""One training run for the resume-on-another-layout tests: the same global batch on any number of processes.

``run(every, out=..., save_at=..., resume=...)`` trains 2 epochs of a 48-sample dataset (random
augmentation seeded per sample, so the same on any layout) with ``distributed(fast_loader(...))``, batch 4
(``batch=``) per rank, ``@accumulate(every, model=)`` (DDP under a process group), SGD with momentum, a
StepLR scheduler and ``LossTracker(all_ranks=True)``; no dropout. ``batchnorm=True`` puts a ``BatchNorm1d``
in the model: its output depends on the micro-batch as a whole, so another layout follows the run only with
the saving layout's micro-batches. It saves after the micro-steps in
``save_at`` (``k<K>.pt`` in ``out``) and returns the final weights and counters. Used in-process by
tests/checkpoint/test_layout_change.py and under torchrun by tests/workers/elastic_resume.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedups import (
    LossTracker,
    accumulate,
    ddp_wrap,
    distributed,
    fast_loader,
    load_checkpoint,
    save_checkpoint,
    world_size,
)
from tests._loading_data import Noisy

N, BATCH, EPOCHS = 48, 4, 2


def build(every: int, items: bool = False, batch: int = BATCH, batchnorm: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if batchnorm else []
    model: nn.Module = nn.Sequential(nn.Linear(6, 16), *norm, nn.Tanh(), nn.Linear(16, 1))
    if world_size() > 1:
        model = ddp_wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    data = Noisy(N, scale=3)
    loader = distributed(fast_loader(data, batch, shuffle=True, num_workers=0, seed=3, sample_seeds=True))

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.mse_loss(model(x), y)
        return (loss, len(y)) if items else loss

    step = accumulate(every, opt, scheduler=sched, model=model)(loss_fn)
    tracker = LossTracker(all_ranks=True)
    return dict(model=model, optimizer=opt, scheduler=sched, loader=loader, step=step, tracker=tracker)


def run(
    every: int, *, out: Path | None = None, save_at: tuple[int, ...] = (), resume: Path | None = None,
    items: bool = False, batch: int = BATCH, batchnorm: bool = False,
) -> dict[str, Any]:  # fmt: skip
    state = build(every, items, batch, batchnorm)
    step, loader, tracker = state["step"], state["loader"], state["tracker"]
    start = 0 if resume is None else load_checkpoint(resume, **state)["epoch"]
    for epoch in range(start, EPOCHS):
        for x, y in step.epoch(loader):
            out_ = step(x, y)
            tracker.update(out_[0] if items else out_, n=len(y))
            if out is not None and step.step in save_at:
                save_checkpoint(out / f"k{step.step}.pt", **state, epoch=epoch)
    model = state["model"]
    return {
        "weights": [p.detach().clone() for p in getattr(model, "module", model).parameters()],
        "updates": step.num_updates,
        "micro_steps": step.step,
        "lr": state["scheduler"].get_last_lr(),
        "mean": tracker.compute(),
    }

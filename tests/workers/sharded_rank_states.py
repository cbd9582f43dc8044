"""Worker: per-rank state in an FSDP2 checkpoint directory comes back to its own rank, on 2 gloo ranks.

Usage: sharded_rank_states.py OUT_DIR. For each mode, ``once`` (one save) and ``twice`` (a save after 2
calls, then one after 4 over the same directory), every rank trains a 2-rank FSDP2 model (``ddp_wrap(...,
strategy="fsdp")``) with ``@accumulate(2, ...)`` on its own batches of a ``distributed`` loader, its own
RNG streams and its own ``LossTracker``; saves them all and two plain values (``who`` differs per rank);
draws from its RNGs and trains 2 more calls (the uninterrupted run); then loads into a fresh tracker and
loader, draws and trains the same 2 calls again. Writes ``<mode>-rank<R>.pt``: the states saved and
loaded, the draws and losses of both continuations, what ``load_checkpoint`` returned and whether the model
came back bitwise.
"""

import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from speedups import (
    LossTracker,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    distributed,
    load_checkpoint,
    save_checkpoint,
)

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()


def draws():
    return {"torch": torch.rand(4), "random": [random.random() for _ in range(3)]}


def full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def run(mode):
    torch.manual_seed(0)  # the same model on every rank
    model = ddp_wrap(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), strategy="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step = accumulate(2, opt, model=model)(lambda x: model(x).square().mean())

    def make_loader():
        return distributed(DataLoader(torch.arange(32.0), batch_size=2), shuffle=True)

    def call(batches, tracker):
        x = torch.randn(2, 3) + next(batches)[:, None]  # this rank's RNG and samples
        loss = train_step(x)
        tracker.update(loss, n=2)
        return loss.item()

    torch.manual_seed(1000 + rank)  # each rank its own streams from here
    random.seed(1000 + rank)
    loader, tracker = make_loader(), LossTracker()
    batches = iter(loader)
    ckpt = out / f"{mode}_ckpt"
    losses = [call(batches, tracker) for _ in range(2)]
    if mode == "twice":
        save_checkpoint(ckpt, model=model, optimizer=opt, step=train_step, loader=loader, tracker=tracker)
    losses += [call(batches, tracker) for _ in range(2)]
    saved = {"tracker": tracker.state_dict(), "step": train_step.state_dict(), "loader": loader.state_dict()}
    weights = full(model)
    state = {"model": model, "optimizer": opt, "step": train_step, "loader": loader, "tracker": tracker}
    save_checkpoint(ckpt, **state, calls=4, who=rank)
    uninterrupted = {"draws": draws(), "losses": [call(batches, tracker) for _ in range(2)]}
    uninterrupted["tracker"] = tracker.compute()
    del batches  # the loader's pass ends (a loader is loaded before its next pass)

    fresh_loader, fresh_tracker = make_loader(), LossTracker()
    extra = load_checkpoint(
        ckpt, model=model, optimizer=opt, step=train_step, loader=fresh_loader, tracker=fresh_tracker
    )
    loaded = {
        "tracker": fresh_tracker.state_dict(),
        "step": train_step.state_dict(),
        "loader": fresh_loader.state_dict(),
    }
    model_back = all(torch.equal(a, b) for a, b in zip(weights, full(model), strict=True))
    batches = iter(fresh_loader)
    resumed = {"draws": draws(), "losses": [call(batches, fresh_tracker) for _ in range(2)]}
    resumed["tracker"] = fresh_tracker.compute()
    del batches
    torch.save(
        {
            "losses": losses,
            "saved": saved,
            "loaded": loaded,
            "uninterrupted": uninterrupted,
            "resumed": resumed,
            "extra": extra,
            "model_back": model_back,
        },
        out / f"{mode}-rank{rank}.pt",
    )


for name in ("once", "twice"):
    run(name)
destroy_distributed()  # gc, then a barrier: gloo's teardown abort at exit never comes

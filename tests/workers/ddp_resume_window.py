"""Worker: a 2-rank DDP run stopped after every micro-step of a window and resumed, each rank on its own.

Usage (under torchrun, 2 gloo processes): ``ddp_resume_window.py PRECISION OUT_DIR full`` runs the
uninterrupted reference (``ref-rank<r>.pt``), then the same run saving a checkpoint after every micro-step of
epoch 0 (``k<k>.pt``; its result ``saving-rank<r>.pt``). ``... resume K[,K...] [TAG]`` builds everything
afresh for each K, loads ``k<K>[TAG].pt`` and finishes the run (``resumed-<K><TAG>-rank<r>.pt``).

The run: ``ddp_wrap``, dropout drawing per rank (each rank seeds its own stream), ``@accumulate(3, model=)``
over 6 micro-steps per epoch (2 windows, both applied), 2 epochs, AdamW, PRECISION fp32 or bf16 (CPU
autocast), a loader with one persistent worker per rank and random augmentation (``sample_seeds=True``), a
``LossTracker`` per rank. Every rank's pending gradients, RNG states and tracker differ, so a rank resumed
with another rank's state ends elsewhere.
"""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speedups import (
    LossTracker,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    distributed,
    fast_loader,
    init_distributed,
    load_checkpoint,
    mixed_precision,
    save_checkpoint,
)
from tests._loading_data import Noisy

precision, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
N, BATCH, EVERY, EPOCHS = 48, 4, 3, 2
torch.set_num_threads(1)
init_distributed()
RANK = torch.distributed.get_rank()


def build():
    torch.manual_seed(100 + RANK)  # each rank its own stream: dropout masks and the workers' seeds differ
    model = ddp_wrap(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = distributed(fast_loader(Noisy(N), BATCH, shuffle=True, num_workers=1, sample_seeds=True))

    def loss_fn(x, y):
        return F.mse_loss(model(x).float(), y)

    if precision == "bf16":
        loss_fn = mixed_precision("bf16", device_type="cpu")(loss_fn)
    return model, opt, loader, accumulate(EVERY, opt, model=model)(loss_fn), LossTracker()


def run(resume_from=None, save=False):
    model, opt, loader, step, tracker = build()
    state = dict(model=model, optimizer=opt, loader=loader, step=step, tracker=tracker)
    start = 0 if resume_from is None else load_checkpoint(resume_from, **state)["epoch"]
    for epoch in range(start, EPOCHS):
        for x, y in step.epoch(loader):
            tracker.update(step(x, y))
            if save and epoch == 0:
                save_checkpoint(out / f"k{step.step}.pt", **state, epoch=epoch)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "optimizer": opt.state_dict()["state"],
        "updates": (step.step, step.num_updates),
        "tracker": tracker.state_dict(),
    }


if mode == "full":
    torch.save(run(), out / f"ref-rank{RANK}.pt")
    torch.save(run(save=True), out / f"saving-rank{RANK}.pt")
else:
    tag = sys.argv[5] if len(sys.argv) > 5 else ""
    for k in sys.argv[4].split(","):
        torch.save(run(resume_from=out / f"k{k}{tag}.pt"), out / f"resumed-{k}{tag}-rank{RANK}.pt")
destroy_distributed()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # see accumulate_ddp.py: gloo + DDP may abort in interpreter finalisation on torch 2.14

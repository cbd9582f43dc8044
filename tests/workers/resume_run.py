"""Worker: a 2-epoch run built from speedups' pieces, stopped and resumed from checkpoints in fresh processes.

Usage: ``resume_run.py PRECISION OUT_DIR full`` runs the uninterrupted reference, then the same run saving a
checkpoint after every micro-step k of epoch 0 (``k<k>.pt``) and at its end (``kend.pt``), and writes both
results (``ref<R>.pt``, ``saving<R>.pt``). ``resume_run.py PRECISION OUT_DIR resume K[,K...]`` starts a
fresh run per K (a process forked before anything trained; under torchrun, the torchrun processes), loads
``k<K>.pt`` and finishes it (``resumed-<K><R>.pt``). ``<R>`` is ``-rank<r>`` under torchrun (2 gloo
processes, DDP through ``ddp_wrap``), empty otherwise.

The run: ``distributed(fast_loader(shuffle=True, num_workers=2))`` (persistent workers except in fp32),
dropout, ``@accumulate(3)`` over 5 micro-steps per epoch (windows of 3 and 2), AdamW with a StepLR
scheduler, ``mixed_precision`` bf16 or fp16 with a CPU GradScaler (only the step is saved, not the
``mixed_precision`` object), ``LossTracker``. Every micro-step's sample indices and inputs are recorded.
PRECISION ``augment`` is fp32 with random augmentation in ``__getitem__`` (torch, ``random`` and NumPy
draws) in 2 persistent workers, under ``fast_loader(..., sample_seeds=True)``.
"""

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from speedups import (
    LossTracker,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    distributed,
    fast_loader,
    load_checkpoint,
    mixed_precision,
    save_checkpoint,
)

EPOCHS, N, BATCH, EVERY = 2, 20, 4, 3
precision, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
DDP = "WORLD_SIZE" in os.environ
torch.set_num_threads(1)


class Augmented(Dataset):
    """A TensorDataset's items with noise drawn in __getitem__ from torch, random and NumPy."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        idx, x, y = self.data[i]
        noise = torch.randn(4) * 0.1 + random.gauss(0.0, 0.1) + float(np.random.normal(0.0, 0.1))
        return idx, x + noise, y


def build():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g) * 3)
    augment = precision == "augment"
    if augment:
        data = Augmented(data)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 1))
    if DDP:
        model = ddp_wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    extra = {"persistent_workers": False} if precision == "fp32" else {}
    loader = distributed(fast_loader(data, BATCH, shuffle=True, num_workers=2, sample_seeds=augment, **extra))
    amp = None
    if precision == "bf16":
        amp = mixed_precision("bf16", device_type="cpu")
    elif precision == "fp16":  # a first scale that overflows: the first windows are skipped, the scale drops
        amp = mixed_precision("fp16", device_type="cpu", init_scale=2.0**17)

    def step(x, y):
        return F.mse_loss(model(x), y)

    if amp is not None:
        step = amp(step)
    train_step = accumulate(EVERY, opt, scheduler=sched, model=model)(step)
    return model, opt, sched, loader, train_step, LossTracker(all_ranks=DDP)


def run(resume_from=None, save_dir=None):
    model, opt, sched, loader, train_step, tracker = build()
    state = dict(model=model, optimizer=opt, scheduler=sched, loader=loader, step=train_step, tracker=tracker)
    start = 0
    if resume_from is not None:
        start = load_checkpoint(resume_from, **state)["epoch"]
    seen = []
    for epoch in range(start, EPOCHS):
        for idx, x, y in train_step.epoch(loader):
            loss = train_step(x, y)
            tracker.update(loss, n=len(y))
            seen.append((train_step.step, idx.clone(), x.clone()))
            if save_dir is not None and epoch == 0:
                save_checkpoint(save_dir / f"k{train_step.step}.pt", **state, epoch=epoch)
        tracker.end_epoch()
        if save_dir is not None and epoch == 0:
            save_checkpoint(save_dir / "kend.pt", **state, epoch=epoch + 1)
    scaler = train_step.scaler
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "optimizer": opt.state_dict()["state"],
        "scale": None if scaler is None else scaler.get_scale(),
        "tracker": tracker.state_dict(),
        "lr": sched.get_last_lr(),
        "updates": (train_step.step, train_step.num_updates),
        "seen": seen,
    }


if mode == "full":
    ref = run()
    suffix = f"-rank{torch.distributed.get_rank()}" if DDP else ""
    torch.save(ref, out / f"ref{suffix}.pt")
    torch.save(run(save_dir=out), out / f"saving{suffix}.pt")
elif DDP:
    k = sys.argv[4]
    result = run(resume_from=out / f"k{k}.pt")
    torch.save(result, out / f"resumed-{k}-rank{torch.distributed.get_rank()}.pt")
else:
    # One process per resume, each forked from this one before it trained or loaded anything: it starts
    # with nothing of any run in memory, as a new process would, without paying torch's import again.
    for k in sys.argv[4].split(","):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.save(run(resume_from=out / f"k{k}.pt"), out / f"resumed-{k}.pt")
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"the resume after micro-step {k} failed (exit status {status})")
if DDP:
    destroy_distributed()

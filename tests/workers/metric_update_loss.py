"""Worker: log_update's loss on 1 or 2 ranks against a plain PyTorch loop with the same global batch.

Usage: metric_update_loss.py OUT_DIR mean|items (under torchrun, 1 or 2 processes). The job's data is the
same for every world size: 2 epochs of 5 micro-steps, accumulate(2) (windows of 2, 2 and a flushed 1: 6
updates). Under 2 ranks each rank takes its share of every micro-step (mean: 4 items each; items: unequal
counts, the step returns ``(loss, n)``); one process takes both shares at once. A DDP model logs through
two MetricLoggers (OUT_DIR/default, OUT_DIR/all_ranks). Rank 0 writes OUT_DIR/reference.json, the window
losses of a plain PyTorch loop over the global batch. Then the same run again, with log_update registered
on rank 0 only (OUT_DIR/alone) beside a hook that writes rank 0's own loss (OUT_DIR/own.csv).
Prints per rank: ``all_reduces_issued`` (asynchronous ones, from log_update), ``waits_before_flush``
(waits on an all-reduce not yet done, before the loggers closed), and on rank 0 under 2 ranks ``alone=``
the warning given.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from speedups import MetricLogger, accumulate
from speedups.metrics import logger as logger_module
from tests._dist import say

out, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
logger_module._ALONE_AFTER_S = 1.0

g = torch.Generator().manual_seed(0)
sizes = [[4, 2, 3, 4, 1], [3, 3, 2, 1, 4]] if mode == "items" else [[4] * 5, [4] * 5]
shares = [  # shares[i][r]: rank r's part of micro-step i of the job
    [(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)) for n in (sizes[0][i], sizes[1][i])]
    for i in range(5)
]


def mine(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's micro-batch i: its share under 2 ranks, both shares in one process."""
    parts = shares[i] if world == 1 else [shares[i][rank]]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def train(hooks: list) -> None:
    torch.manual_seed(1)
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(x, y):
        loss = F.mse_loss(model(x), y)
        return (loss, len(y)) if mode == "items" else loss

    train_step = accumulate(2, opt, model=model)(loss_fn)
    for hook in hooks:
        train_step.on_update(hook)
    for _epoch in range(2):
        for i in train_step.epoch(range(5)):
            train_step(*mine(i))


def reference() -> list[float]:
    """The window losses of a plain loop over the job's batches (mean: of the micro-batch means)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _epoch in range(2):
        for window in (range(0, 2), range(2, 4), range(4, 5)):
            batches = [share for i in window for share in shares[i]]
            if mode == "items":  # the mean over every item of the window
                xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
                loss = F.mse_loss(model(xs), ys)
            else:  # the mean of every rank's micro-batch means
                loss = torch.stack([F.mse_loss(model(x), y) for x, y in batches]).mean()
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return losses


issued, blocking = [0], [0]
reduce = dist.all_reduce


class Counted:
    """An all-reduce's work that counts the waits made before it was done."""

    def __init__(self, work) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self):
        blocking[0] += not self.work.is_completed()
        return self.work.wait()


def counting(tensor, *args, **kwargs):
    work = reduce(tensor, *args, **kwargs)
    if not kwargs.get("async_op") or tensor.shape != (2,) or tensor.dtype != torch.float64:
        return work  # not log_update's (sum, count): the step's own item count, a flush's all-reduce
    issued[0] += 1
    return Counted(work)


dist.all_reduce = counting
default = MetricLogger(out / "default", every=4)
everyone = MetricLogger(out / "all_ranks", every=4, all_ranks=True)
train([default.log_update, everyone.log_update])
say(f"rank{rank} waits_before_flush={blocking[0]}")
default.close()
everyone.close()
dist.all_reduce = reduce
say(f"rank{rank} all_reduces_issued={issued[0]}")
if rank == 0:
    (out / "reference.json").write_text(json.dumps(reference()))

own: list[float] = []
hooks = []
if rank == 0:
    alone = MetricLogger(out / "alone", every=4)
    hooks = [alone.log_update, lambda record: own.append(record.loss.item())]
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    train(hooks)
if rank == 0:
    alone.close()
    (out / "own.csv").write_text("loss\n" + "".join(f"{v!r}\n" for v in own))
    if world == 2:
        say(f"rank0 alone={' | '.join(str(w.message) for w in said)}")
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # torch + gloo + DDP may abort in interpreter finalisation (see accumulate_ddp.py)

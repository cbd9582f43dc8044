"""Worker: MetricLogger(all_ranks=True) in a 2-rank job writes one file, rank 0's, with the global means.

Usage: metric_logger_ranks.py OUT_DIR. Each rank logs, at steps 0..9, loss = step + rank (a tensor) and a
LossTracker fed rank-dependent values and counts (rank 0: value 1 with n=1; rank 1: value 4 with n=3 per
step) and lr = 0.1 * (rank + 1), every=4, then a row of host values only at step 9 (eval = rank): three
flushes and three all-reduces. Prints the all-reduce count per rank. The same again into OUT_DIR/device with
CPU tensors standing in for device tensors. Then a default logger (rank 0's values) writes
OUT_DIR/rank0/metrics.csv. Last, rank 1 leaves out a value at one step: every rank refuses the flush.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from speedups import LossTracker, MetricLogger, SpeedupsError, destroy_distributed, init_distributed, rank
from speedups.metrics import logger as logger_module
from tests._dist import say

out = Path(sys.argv[1])
init_distributed()
me = rank()
calls = [0]
reduce = dist.all_reduce


def counting(*args, **kwargs):
    calls[0] += 1
    return reduce(*args, **kwargs)


dist.all_reduce = counting  # count the logger's collectives


def run(folder: Path) -> None:
    tracker = LossTracker()
    logger = MetricLogger(folder, sinks=["csv", "jsonl"], every=4, all_ranks=True)
    for step in range(10):
        tracker.update(torch.tensor(1.0 if me == 0 else 4.0), 1 if me == 0 else 3)
        logger.log(step, loss=torch.tensor(float(step + me)), seen=tracker, lr=0.1 * (me + 1))
    logger.log(9, eval=float(me))  # a row of host values only
    logger.close()


run(out)
dist.all_reduce = reduce
say(f"rank{me} all_reduces={calls[0]}")
logger_module._CPU_READS_ARE_FREE = False  # the same with CPU tensors standing in for device tensors
run(out / "device")
logger_module._CPU_READS_ARE_FREE = True
with MetricLogger(out / "rank0", sinks="csv", every=4) as own:  # default: rank 0's values, no collective
    for step in range(10):
        own.log(step, loss=torch.tensor(float(step + me)))
odd = MetricLogger(out / "odd", sinks="csv", every=4, all_ranks=True)
try:
    for step in range(4):  # rank 1 has no grad norm at step 2: the all-reduce would not match
        odd.log(step, loss=1.0, grad_norm=None if (me == 1 and step == 2) else 2.0)
except SpeedupsError as err:
    say(f"rank{me} refused: {err}")
destroy_distributed()  # gc, then a barrier: gloo's teardown abort at exit never comes

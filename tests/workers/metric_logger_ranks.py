"""Worker: MetricLogger(all_ranks=True) in a 2-rank job writes one file, rank 0's, with the global means.

Usage: metric_logger_ranks.py OUT_DIR. Each rank logs, at steps 0..9, loss = step + rank (a tensor) and a
LossTracker fed rank-dependent values and counts (rank 0: value 1 with n=1; rank 1: value 4 with n=3 per
step), every=4, so three flushes and three all-reduces. Prints the all-reduce count per rank.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from speedups import LossTracker, MetricLogger, init_distributed, rank
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
tracker = LossTracker()
logger = MetricLogger(out, sinks=["csv", "jsonl"], every=4, all_ranks=True)
for step in range(10):
    tracker.update(torch.tensor(1.0 if me == 0 else 4.0), 1 if me == 0 else 3)
    logger.log(step, loss=torch.tensor(float(step + me)), seen=tracker)
logger.close()
dist.all_reduce = reduce
say(f"rank{me} all_reduces={calls[0]}")
dist.barrier()
dist.destroy_process_group()

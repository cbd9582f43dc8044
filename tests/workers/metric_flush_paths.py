"""Worker: every way a MetricLogger is flushed, on 2 ranks, for every count of pending rows (0 included).

Usage: metric_flush_paths.py OUT_DIR. For all_ranks in (True, False), every path (close, the end of a
with-block, state_dict then close, flush twice then close, the automatic flush then close) and every number
of logged steps 0..7 with every=3 (so 0, 1 and 2 rows pending when the path runs, and paths right after an
automatic flush): each rank logs loss = step + rank (a tensor, staged as a device value) and lr = 0.1 at
steps 0..n-1 into OUT_DIR/<all|rank0>-<path>-<n>. Prints one line per rank: ``rank<r> failures=<list>``
(what raised, by case) and the state_dict each state_dict case returned.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from speedups import MetricLogger, destroy_distributed, init_distributed, rank
from speedups.metrics import logger as logger_module
from tests._dist import say

out = Path(sys.argv[1])
init_distributed(timeout=30)  # a rank left behind by a failure fails the job in 30 s, not 30 min
me = rank()
logger_module._CPU_READS_ARE_FREE = False  # CPU tensors stand in for a GPU's: staged, read at a flush
failures: list[str] = []
states: list[str] = []


def logged(logger: MetricLogger, n: int) -> None:
    for step in range(n):
        logger.log(step, loss=torch.tensor(float(step + me)), lr=0.1)


for all_ranks in (True, False):
    for path in ("close", "with", "state_dict", "flush_twice", "automatic"):
        for n in range(8):
            name = f"{'all' if all_ranks else 'rank0'}-{path}-{n}"
            folder = out / name
            try:
                if path == "with":
                    with MetricLogger(folder, every=3, all_ranks=all_ranks) as logger:
                        logged(logger, n)
                    continue
                logger = MetricLogger(folder, every=3, all_ranks=all_ranks)
                logged(logger, n)
                if path == "state_dict":
                    states.append(f"{name}={logger.state_dict()}")
                    states.append(f"{name}/again={logger.state_dict()}")
                elif path == "flush_twice":
                    logger.flush()
                    logger.flush()
                elif path == "automatic":  # up to the next multiple of every: the last log flushes
                    for step in range(n, n + (-n % 3)):
                        logger.log(step, loss=torch.tensor(float(step + me)), lr=0.1)
                logger.close()
                logger.close()  # a second close does nothing
            except Exception as err:  # reported by case
                failures.append(f"{name}: {type(err).__name__}: {err}")
            dist.barrier()  # a rank that failed must not run into the next case's collectives

say(f"rank{me} failures={failures}")
say(f"rank{me} states={';'.join(states)}")
destroy_distributed()

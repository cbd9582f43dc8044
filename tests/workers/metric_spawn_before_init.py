"""Worker: MetricLogger made by mp.spawn'd processes before their process group exists (rank unknown then).

Usage: metric_spawn_before_init.py OUT_DIR PORT. Two spawned processes each make MetricLogger(OUT_DIR,
every=2, all_ranks=True) before init_process_group, then log loss = step + rank at steps 0..4 and close:
the writer is decided at the first write (rank 0), so the second process is not refused and one file holds
the means. Prints ``rank<r> ok`` per process.
"""

import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from speedups import MetricLogger
from tests._dist import say


def work(rank: int, out: str, port: str) -> None:
    logger = MetricLogger(out, every=2, all_ranks=True)  # no process group yet: rank 0 of 1, as far as known
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for step in range(5):
        logger.log(step, loss=float(step + rank))
    logger.close()
    dist.barrier()
    dist.destroy_process_group()
    say(f"rank{rank} ok")


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2]), nprocs=2)

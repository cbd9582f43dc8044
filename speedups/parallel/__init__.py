"""Tip 9, the processes: the process group, ``launch()``, ``ddp_wrap``, ``gather`` and rank helpers.

Which process this is and which device is its own is answered by the launch environments in
:mod:`speedups._helpers.environments`, which every tip shares.
"""

from speedups.parallel.data_parallel import ddp_wrap
from speedups.parallel.gathering import gather
from speedups.parallel.launcher import launch
from speedups.parallel.main_first import main_process_first
from speedups.parallel.process_group import destroy_distributed, init_distributed
from speedups.parallel.ranks import (
    is_main_process,
    local_rank,
    rank,
    rank_zero_only,
    rank_zero_print,
    world_size,
)
from speedups.parallel.seeding import seed_everything

__all__ = [
    "ddp_wrap",
    "destroy_distributed",
    "gather",
    "init_distributed",
    "is_main_process",
    "launch",
    "local_rank",
    "main_process_first",
    "rank",
    "rank_zero_only",
    "rank_zero_print",
    "seed_everything",
    "world_size",
]

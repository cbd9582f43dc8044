"""Worker: one RunDirectory on 2 ranks holds its directory through rank 0; a second one is refused on both.

Usage: run_directory_ranks.py RUN_DIR. Each rank builds ``RunDirectory(RUN_DIR)``, resumes and saves once;
then a second RunDirectory on RUN_DIR is tried (refused: on every rank, none left waiting); the first is
closed and a third one resumes. Prints one line per rank: ``rank<r> <pid> lock=<the pid in run.lock>
second=<refused|accepted> third=<the values it resumed>``.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from speedups import RunDirectory, SpeedupsError, destroy_distributed, init_distributed, rank
from tests._dist import say

path = Path(sys.argv[1])
init_distributed(timeout=30)  # a rank left behind by a failure fails the job in 30 s, not 30 min
me = rank()
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)

first = RunDirectory(path, every_updates=1, stop_on=None)
first.resume(model=model)
first.save(epoch=0)
dist.barrier()
lock = (path / "run.lock").read_text().split()[0]  # the process id (the host follows)
second = RunDirectory(path, every_updates=1, stop_on=None)
try:
    second.resume(model=model)
    verdict = "accepted"
except SpeedupsError as err:
    verdict = "refused" if "is taken: another RunDirectory" in str(err) else f"other:{err}"
first.close()
dist.barrier()
third = RunDirectory(path, every_updates=1, stop_on=None)
values = third.resume(model=model)
third.save(epoch=1)
third.close()
said = str(values).replace(" ", "")  # one field
say(f"rank{me} {os.getpid()} lock={lock} second={verdict} third={said}")
destroy_distributed()

"""Worker: the run of tests/_elastic.py on 2 processes (torchrun, gloo): saving, or resuming 1-process files.

Usage: ``elastic_resume.py OUT_DIR EVERY save K[,K...] [items] [batchnorm]`` runs 2 epochs with
``accumulate(EVERY)`` saving after micro-steps K (``k<K>.pt``) and writes the result (``two.pt``, rank 0).
``... resume K[,K...] [items] [batchnorm]`` resumes each ``k<K>.pt`` (saved by one process) and writes
``two-from-<K>.pt``, or ``refused-<K>.txt`` with the error when the load is refused.
"""

import os
import sys
from pathlib import Path

import torch

from speedups import SpeedupsError, destroy_distributed, init_distributed, rank
from tests._elastic import run

out, every, mode, points = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
items = "items" in sys.argv[5:]
batchnorm = "batchnorm" in sys.argv[5:]
torch.set_num_threads(1)
init_distributed()
if mode == "save":
    result = run(every, out=out, save_at=tuple(int(k) for k in points), items=items, batchnorm=batchnorm)
    if rank() == 0:
        torch.save(result, out / "two.pt")
else:
    for k in points:
        try:
            result = run(every, resume=out / f"k{k}.pt", items=items, batchnorm=batchnorm)
        except SpeedupsError as err:
            if rank() == 0:
                (out / f"refused-{k}.txt").write_text(str(err))
            continue
        if rank() == 0:
            torch.save(result, out / f"two-from-{k}.pt")
destroy_distributed()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # see accumulate_ddp.py: gloo + DDP may abort in interpreter finalisation on torch 2.14

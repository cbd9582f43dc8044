"""Worker: a speedups collective called on some ranks only must not hang silently.

Usage: one_rank_collectives.py MODE OUT_DIR, 2 ranks, init_distributed(timeout=12).
- save_rank0: nanoGPT's `if master_process: save_checkpoint(...)`: rank 0 saves alone after a few seconds
  (what it holds: the model and optimizer), the job finishes; every rank then loads the file.
- save_rank1: rank 1 alone calls save_checkpoint; rank 0 goes on to destroy_distributed. Both wait at the
  store, say so after 10 s and raise at the 12 s collective timeout.
- tracker: rank 0 alone reads LossTracker(all_ranks=True): it says so and raises at the timeout.
Writes rank<R>.json: {"result": ..., "error": ..., "seconds": ...}.
"""

import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from speedups import (
    LossTracker,
    SpeedupsError,
    accumulate,
    ddp_wrap,
    destroy_distributed,
    init_distributed,
    is_main_process,
    load_checkpoint,
    rank,
    save_checkpoint,
)

mode, out = sys.argv[1], Path(sys.argv[2])
init_distributed(timeout=12)
me = rank()
started = time.monotonic()
result, error = None, None
try:
    if mode == "save_rank0":
        torch.manual_seed(0)
        model = ddp_wrap(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = accumulate(2, opt, model=model)(lambda x, y: F.mse_loss(model(x), y))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(6):
                if i == 2 and is_main_process():  # the literal port of nanoGPT's save
                    save_checkpoint(out / "ckpt.pt", model=model, optimizer=opt, iter_num=i)
                step(torch.randn(8, 4), torch.randn(8, 1))
        saved_weight = None
        torch.distributed.barrier()
        values = load_checkpoint(out / "ckpt.pt", model=torch.nn.Linear(4, 1))
        result = {
            "values": values,
            "warned": [str(w.message) for w in caught if "rank 0 alone" in str(w.message)],
        }
    elif mode == "save_rank1":
        if me == 1:
            save_checkpoint(out / "ckpt.pt", model=torch.nn.Linear(4, 1))
        result = "returned"
    elif mode == "tracker":
        tracker = LossTracker(all_ranks=True)
        tracker.update(torch.tensor(1.0))
        if me == 0:
            result = tracker.compute()
    destroy_distributed()
except SpeedupsError as err:
    error = str(err)
(out / f"rank{me}.json").write_text(
    json.dumps({"result": result, "error": error, "seconds": time.monotonic() - started})
)

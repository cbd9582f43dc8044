"""Worker: the seam matrix beside DDP, on 2 gloo ranks (``tests/seams``).

Usage: seam_pairs_ddp.py FOLDER. Runs DDP alone and DDP beside each lever of ``tests/seams/levers.py`` that
runs under DDP: speedups' loop (``ddp_wrap``, ``distributed()``, ``@accumulate(model=ddp)``) against the
hand-written one (``DistributedDataParallel``, ``DistributedSampler`` with ``set_epoch``, ``no_sync()``),
each rank on its share of the data. Rank 0 prints one line per case: ``case <name> <ok|WRONG> <diffs>``,
each rank's worst difference taken.
"""

import sys

import torch
import torch.distributed as dist

from speedups import destroy_distributed
from tests.seams.levers import LEVERS, recipe_of
from tests.seams.loops import Recipe, differences, run_reference, run_speedups

folder = sys.argv[1]
dist.init_process_group("gloo")
torch.set_num_threads(1)
cases = [("ddp", (), 1e-5)] + [(f"ddp+{lever.name}", (lever,), max(lever.tolerance, 1e-5))
                               for lever in LEVERS if lever.ddp]  # fmt: skip
for name, levers, tolerance in cases:
    recipe = Recipe(**{**recipe_of(*levers).__dict__, "ddp": True})
    want = run_reference(recipe)
    got = run_speedups(recipe, folder)
    diff = differences(got, want)
    worst = torch.tensor([diff[k] for k in ("params", "buffers", "losses", "rng")], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = bool((worst <= tolerance).all()) and len(got.losses) == len(want.losses)
    if dist.get_rank() == 0:
        print(f"case {name} {'ok' if ok else 'WRONG'} {worst.tolist()}", flush=True)
    dist.barrier()
destroy_distributed()

"""Worker: micro_batch_size="auto" on a 2-rank DDP model where only rank 0 runs out of memory.

Usage: micro_batch_ddp.py mean|items. Rank 0 "runs out of memory" (raises torch.OutOfMemoryError) in forward
above 6 rows and, from a tensor hook, in backward above 3 rows; its second call (7 rows) ends the first
window, so both failures happen in the call whose backward would synchronise. Rank 1 never runs out. Five
calls with accumulate(2): two windows and a flushed one. Prints one line per rank: the largest distance to
a single-process reference on the global data, the largest distance between the ranks, the micro-batch
size found, and how often DDP's own comm hook ran (0: every micro-backward ran inside no_sync).
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from speedups.accumulation import accumulate
from tests._dist import count_all_reduces, distances, say

mode = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang fails, never waits
rank, world = dist.get_rank(), dist.get_world_size()
EVERY = 2

torch.manual_seed(0)
sizes = [[3, 7, 5, 2, 4], [5, 2, 6, 3, 4]]  # sizes[rank][call]
batches = []  # batches[rank][call] = (x, y, mask)
for r in range(world):
    batches.append([])
    for n in sizes[r]:
        mask = torch.rand(n) > 0.3
        mask[0] = True
        batches[r].append((torch.randn(n, 3), torch.randn(n, 1), mask))


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


base, ref = make_model(), make_model()
ddp_model = DistributedDataParallel(base)
hook_calls = count_all_reduces(ddp_model)
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)


def out_of_memory_above(limit, rows):
    def hook(*_):
        if rank == 0 and rows > limit:
            raise torch.OutOfMemoryError(f"simulated on rank 0: {rows} rows > {limit}")

    return hook


def per_row_loss(model, x, y):
    return (model(x) - y).pow(2).squeeze(1)


def loss_fn(x, y, mask):
    out_of_memory_above(6, len(x))()  # in forward
    h = ddp_model(x)
    h.register_hook(out_of_memory_above(3, len(x)))  # in backward
    per_row = (h - y).pow(2).squeeze(1)
    if mode == "items":
        return {"loss": per_row[mask].sum() / mask.sum(), "num_items": mask.sum(), "rows": len(x)}
    return per_row.mean()


train_step = accumulate(EVERY, opt, model=ddp_model, micro_batch_size="auto")(loss_fn)

for batch in train_step.epoch(batches[rank]):
    train_step(*batch)

for start in range(0, len(sizes[0]), EVERY):  # reference: the global window in one process
    window = [batches[r][i] for r in range(world) for i in range(start, min(start + EVERY, len(sizes[0])))]
    if mode == "items":
        ref_loss = sum((per_row_loss(ref, x, y) * m).sum() for x, y, m in window) / sum(
            m.sum() for *_, m in window
        )
    else:
        ref_loss = torch.stack([per_row_loss(ref, x, y).mean() for x, y, _ in window]).mean()
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()

to_ref, between = distances(ddp_model, ref)
say(
    f"rank{rank} to_ref={to_ref:.3e} between={between:.3e} size={train_step.micro_batch_size} "
    f"hook_calls={hook_calls[0]} updates={train_step.num_updates}"
)
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # see accumulate_ddp.py: gloo + DDP may abort during interpreter finalisation

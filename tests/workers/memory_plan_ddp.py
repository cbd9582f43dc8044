"""Worker: @accumulate(..., memory_budget=...) on a 2-rank DDP model: both ranks plan alike and stay in step.

Usage: memory_plan_ddp.py OUT_DIR. Each rank trains ``ddp_wrap(Blocks)`` on its own batches with a budget of
half the activations one plain call keeps; writes rank<R>.pt with the plan chosen, what it tried, the
checkpointed blocks, the micro-batch size and the weights.
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from speedups import accumulate, ddp_wrap, destroy_distributed
from speedups.memory import checkpointed
from speedups.memory.saved_activations import SavedActivations
from tests._models import Blocks

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
plain = Blocks(depth=4, width=32).eval()  # no dropout: the plan's calls run at other sizes than others
with SavedActivations(plain) as counted:
    plain(torch.randn(16, 3)).sum().backward()
budget = counted.peak_bytes // 2

model = ddp_wrap(Blocks(depth=4, width=32).eval())
opt = torch.optim.SGD(model.parameters(), lr=0.05)


@accumulate(2, opt, memory_budget=budget, model=model)
def step(x, y):
    # The ranks disagree on what is fast (rank 0 is slow on whole batches, rank 1 on split ones): alone,
    # each would choose another plan.
    if (rank == 0) == (len(x) == 16):
        time.sleep(0.02)
    return F.mse_loss(model(x), y)


g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
for _ in range(24):
    step(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))
plan = step._acc().micro.plan
torch.save(
    {
        "choice": step.memory_plan,
        "tried": plan.tried,
        "checkpointed": checkpointed(model),
        "size": step.micro_batch_size,
        "budget": budget,
        "params": [p.detach().clone() for p in model.parameters()],
    },
    out / f"rank{rank}.pt",
)
model = step = None  # the DDP model must be gone before the process group (see destroy_distributed)
destroy_distributed()

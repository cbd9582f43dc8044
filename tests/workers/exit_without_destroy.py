"""A 2-process gloo script that leaves its process group open at exit: a DDP model alive (a module global)
and a collective just before the script ends, the moment gloo's threads are still freeing its work.

Run by tests/parallel/test_process_group.py with torchrun; DESTROY=1 ends with destroy_distributed().
Before speedups ended the group at exit, about 1 exit in 4 aborted ("terminate called without an active
exception", exit code -6)."""

import os

import torch
import torch.distributed as dist

from speedups import ddp_wrap, destroy_distributed

model = ddp_wrap(torch.nn.Linear(4, 1))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
total = torch.ones(3)
dist.all_reduce(total)
assert total.tolist() == [2.0, 2.0, 2.0]
if os.environ.get("DESTROY") == "1":
    destroy_distributed()

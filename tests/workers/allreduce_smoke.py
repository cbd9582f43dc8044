"""Smoke worker: all-reduce the rank and print it (checks the launcher helpers themselves)."""

import os

import torch
import torch.distributed as dist

from tests._dist import say

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
rank, world = dist.get_rank(), dist.get_world_size()
say(f"rank={rank} local_rank={os.environ['LOCAL_RANK']} world={world} sum={t.item()}")
dist.destroy_process_group()

"""Worker: @accumulate on 2 DDP ranks, compiled in either order, with a branch some windows never use.

Usage: accumulate_compose_ddp.py. The model has a trunk ``a`` every call uses and a branch ``b`` only some
micro-batches use (``find_unused_parameters=True``). For each wrapping (plain DDP, ``torch.compile(ddp)``,
``DDP(torch.compile(model))``; compile with backend="eager": the same OptimizedModule as inductor, without a
C++ toolchain) every rank runs two epochs of 5 micro-batches with ``accumulate(3, Adam)`` and
``(loss, num_items)`` of unequal sizes: per epoch one full window and one flushed short window. Epoch 0 uses
``b`` on rank 0 in the full window and on rank 1 only in the short one; epoch 1 never uses ``b``, so Adam must
not move it (its gradient stays None, as DDP leaves it). The reference is plain PyTorch in this process: one
Adam step per window on the concatenation of both ranks' micro-batches. Prints one line per wrapping:
``rank=R order=O to_ref=... between_ranks=... b_moved=... hook_calls=... updates=...``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from speedups.accumulation import accumulate
from tests._dist import count_all_reduces, distances, say

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 1)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = self.a(x)
        return out + self.b(x) if use_b else out


torch.manual_seed(0)
sizes = {0: [4, 2, 3, 4, 1], 1: [3, 3, 2, 1, 4]}  # per rank, per micro-step
USES_B = [  # USES_B[epoch][rank][micro-step]
    {0: [True, False, False, False, False], 1: [False, False, False, False, True]},
    {0: [False] * 5, 1: [False] * 5},
]
data = {  # data[epoch][rank] = [(x, y), ...]
    epoch: {r: [(torch.randn(n, 3), torch.randn(n, 1)) for n in sizes[r]] for r in range(world)}
    for epoch in range(2)
}
WINDOWS = (range(0, 3), range(3, 5))


def run(order: str) -> None:
    torch.manual_seed(1)
    base = Net()
    ref = Net()
    ref.load_state_dict(base.state_dict())
    ddp = DistributedDataParallel(
        torch.compile(base, backend="eager") if order == "ddp(compile)" else base,
        find_unused_parameters=True,
    )
    calls = count_all_reduces(ddp)
    model = torch.compile(ddp, backend="eager") if order == "compile(ddp)" else ddp
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)

    def loss_fn(x, y, use_b):
        return F.mse_loss(model(x, use_b), y), len(y)

    train_step = accumulate(3, opt, model=model)(loss_fn)
    b_before_epoch1 = None
    for epoch in range(2):
        if epoch == 1:
            b_before_epoch1 = [p.detach().clone() for p in base.b.parameters()]
        batches = [(x, y, USES_B[epoch][rank][i]) for i, (x, y) in enumerate(data[epoch][rank])]
        for x, y, use_b in train_step.epoch(batches):
            train_step(x, y, use_b)
        for window in WINDOWS:  # the reference: every rank's micro-batches of the window together
            ref_opt.zero_grad(set_to_none=True)
            parts = [
                (ref(data[epoch][r][i][0], USES_B[epoch][r][i]) - data[epoch][r][i][1]).pow(2).sum()
                for r in range(world)
                for i in window
            ]
            total = sum(len(data[epoch][r][i][1]) for r in range(world) for i in window)
            (torch.stack(parts).sum() / total).backward()
            ref_opt.step()

    to_ref, between = distances(base, ref)
    assert b_before_epoch1 is not None
    b_now = list(base.b.parameters())
    b_moved = max((p.detach() - q).abs().max().item() for p, q in zip(b_now, b_before_epoch1, strict=True))
    say(
        f"rank={rank} order={order} to_ref={to_ref:.3e} between_ranks={between:.3e} b_moved={b_moved:.3e} "
        f"hook_calls={calls[0]} updates={train_step.num_updates}"
    )


for order in sys.argv[1:] or ["ddp", "compile(ddp)", "ddp(compile)"]:
    run(order)
dist.destroy_process_group()
# torch 2.14 + gloo + DDP sometimes aborts during interpreter finalisation (see accumulate_ddp.py).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)

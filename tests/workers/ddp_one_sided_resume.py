"""Worker: 2 DDP ranks whose pending micro-step used a parameter on one rank only, saved after each
micro-step of two windows and resumed; the weights must equal the run that never stopped, on both ranks.

Usage (under torchrun, 2 gloo processes): ``ddp_one_sided_resume.py OUT_DIR``. For ``find_unused_parameters``
True and False, the run (``@accumulate(2, model=)``, AdamW, 6 micro-steps) is made once whole, then, for
each cut K in 1..4, saved after micro-step K (``save_checkpoint``), built afresh and resumed
(``load_checkpoint``), each rank from its own state. Each rank writes ``result-rank<r>.txt``: a line
``find_unused K equal agree`` per resume (``equal``: torch.equal to the whole run; ``agree``: both ranks end
with the same weights).

The branch (``extra``) is used by one rank only in the windows' first micro-steps (rank 0 in the first and
third, rank 1 in the second), so at a save after it one rank holds gradients for ``extra`` and the other
none; with ``find_unused_parameters=False`` every rank uses it at the boundaries (DDP needs that), with True
no rank does.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speedups import accumulate, ddp_wrap, init_distributed, load_checkpoint, save_checkpoint

out = Path(sys.argv[1])
torch.set_num_threads(1)
init_distributed()
rank = torch.distributed.get_rank()
STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use:
            h = h + self.extra(h)
        return self.out(h)


def uses(m: int, find_unused: bool) -> bool:
    if m % 2:  # a boundary micro-step
        return not find_unused
    one = 1 if m == 2 else 0  # the rank that uses it in this window's first micro-step
    return rank == one


def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * m + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def build(find_unused: bool):
    torch.manual_seed(0)
    model = ddp_wrap(Net(), find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)

    @accumulate(2, opt, model=model)
    def step(x: torch.Tensor, y: torch.Tensor, use: bool) -> torch.Tensor:
        return F.mse_loss(model(x, use), y)

    return model, opt, step


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


lines = []
for find_unused in (True, False):
    model, opt, step = build(find_unused)
    for m in range(STEPS):
        step(*batch(m), uses(m, find_unused))
    whole = flat(model)
    for cut in (1, 2, 3, 4):
        path = out / f"cut{cut}-{find_unused}.pt"
        model, opt, step = build(find_unused)
        for m in range(cut):
            step(*batch(m), uses(m, find_unused))
        save_checkpoint(path, model=model, optimizer=opt, step=step)
        model, opt, step = build(find_unused)  # afresh, as a restarted job
        load_checkpoint(path, model=model, optimizer=opt, step=step)
        for m in range(cut, STEPS):
            step(*batch(m), uses(m, find_unused))
        got = flat(model)
        both = [torch.empty_like(got) for _ in range(2)]
        torch.distributed.all_gather(both, got)
        lines.append(f"{find_unused} {cut} {torch.equal(got, whole)} {torch.equal(both[0], both[1])}")
(out / f"result-rank{rank}.txt").write_text("\n".join(lines) + "\n")

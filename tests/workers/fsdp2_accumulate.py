"""Worker: @accumulate on a 2-rank FSDP2 model against the same FSDP2 training written by hand.

Usage: fsdp2_accumulate.py OUT_DIR. Every rank trains two identical FSDP2 models on its own batches: one
with ``@accumulate(3, ...)`` (plain calls, then ``micro_batch_size=2``; ``"auto"`` is refused), one by hand
(gradient sync off but for a window's last backward, the mean loss divided by the window's calls). Each
epoch has 5 calls, so its last window is a short one of 2 that ``epoch()`` flushes. Writes rank<R>.json with
the largest distances to the hand-written model and between the ranks, and whether a mid-window checkpoint
was written (the run going on unchanged after it).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from speedups import SpeedupsError, accumulate, ddp_wrap, destroy_distributed, save_checkpoint
from tests._dist import distances

EVERY, CALLS, EPOCHS = 3, 5, 2
out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()


def build():
    torch.manual_seed(0)
    return ddp_wrap(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), strategy="fsdp")


g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
data = [
    [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(CALLS)]
    for _ in range(EPOCHS)
]


def by_hand():
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in data:
        windows = [epoch[i : i + EVERY] for i in range(0, CALLS, EVERY)]
        for window in windows:
            for i, (x, y) in enumerate(window):
                model.set_requires_gradient_sync(i + 1 == len(window))
                (F.mse_loss(model(x), y) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    return model


def with_accumulate(**kwargs):
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step = accumulate(EVERY, opt, model=model, **kwargs)(lambda x, y: F.mse_loss(model(x), y))
    saved = None
    for epoch in data:
        for i, (x, y) in enumerate(train_step.epoch(epoch)):
            train_step(x, y)
            if i == 0 and saved is None:  # mid-window: saved as the pending call, the run goes on unchanged
                path = out / f"mid_window_{'_'.join(map(str, kwargs.values())) or 'plain'}"
                save_checkpoint(path, model=model, optimizer=opt, step=train_step)
                saved = (path / ".metadata").is_file()
    assert train_step.num_updates == 2 * EPOCHS, train_step.num_updates
    return model, saved


reference = by_hand()
result = {}
try:  # "auto" could not run a call again on one rank alone: refused before anything is made
    with_accumulate(micro_batch_size="auto")
    result["auto_refused"] = False
except SpeedupsError as err:
    said = str(err)
    result["auto_refused"] = "cannot run its call again alone" in said and "micro_batch_size=<int>" in said
for name, kwargs in [
    ("plain", {}),
    ("micro", {"micro_batch_size": 2}),
]:
    model, saved = with_accumulate(**kwargs)
    to_ref, between = distances(model, reference)
    result[name] = {"to_ref": to_ref, "between": between, "saved": saved}
(out / f"rank{rank}.json").write_text(json.dumps(result))
destroy_distributed()  # gc, then a barrier: gloo's teardown abort at exit never comes

"""A nanoGPT-style train.py (tiny, random tokens): manual accumulation with DDP's sync flag, GradScaler,
autocast through a context, master_process saves, torch.compile of a model of repeated blocks."""
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

batch_size, block_size, vocab = 4, 16, 32
gradient_accumulation_steps = 4
max_iters = int(sys.argv[1]) if len(sys.argv) > 1 else 6
log_interval = 1
compile = False
device = "cuda" if torch.cuda.is_available() else "cpu"
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}"
    master_process = int(os.environ["RANK"]) == 0
else:
    master_process = True
torch.manual_seed(1337)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = torch.bfloat16
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
data = torch.randint(0, vocab, (4096,))


def get_batch(split):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.mlp = nn.Linear(32, 32)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, 32)
        self.h = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


model = GPT().to(device)
scaler = torch.amp.GradScaler(enabled=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
if compile:
    model = torch.compile(model)  # check: compile_blocks
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model
X, Y = get_batch("train")
t0 = time.time()
for iter_num in range(max_iters):
    if iter_num > 0 and iter_num % 1000 == 0 and master_process:
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(checkpoint, "ckpt.pt")  # check: checkpoints
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # check: 4
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"loss={lossf:.6f}")
if ddp:
    destroy_process_group()

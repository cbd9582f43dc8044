"""Benchmark: the memory levers of tips 3 and 4, activation checkpointing and micro-batching, and their plan.

A 12-block pre-norm transformer (width 256, 4 heads, MLP 4x, dropout 0.1, sequence 128, batch 32, next-token
loss over a 256-token vocabulary) on the CPU, AdamW. Variants, timed round-robin in the same run, each a full
optimizer step on the same batch:

- plain: the hand-written loop;
- every block checkpointed: ``checkpoint_activations(model, "blocks.*")``;
- under a budget of half the plain run's activation bytes (counted with ``saved_tensors_hooks``):
  micro-batches only (the largest halving of the batch that fits), checkpointing only (the fewest blocks,
  whole batches), and the plan, ``@accumulate(1, opt, memory_budget=..., model=model)``, timed after it chose.

Each line gives the activation bytes kept at peak and the time per step, both as ratios to plain. Targets:
every block checkpointed saves >= 70% of the bytes at <= 1.4x the time; the plan is no slower than the better
of the two single levers. The last line says so:
``memory: checkpointing saves X% of activation bytes at Y.YYx time; plan Z.ZZx of the best single lever``.

    python -m benchmarks.memory            # a few minutes
    python -m benchmarks.memory --quick    # seconds, for the smoke test
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, save_chart
from speedups import accumulate, checkpoint_activations
from speedups.memory.saved_activations import SavedActivations

VOCAB = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP, each with dropout and a residual."""

    def __init__(self, width: int, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(self, depth: int, width: int, seq: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, width), nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), target.flatten())


Setup = tuple[nn.Module, torch.optim.Optimizer]


def build(depth: int, width: int, seq: int) -> Setup:
    model = Transformer(depth, width, seq)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def peak_bytes(model: nn.Module, run: Callable[[], None]) -> int:
    """The activation bytes ``run()`` keeps at peak (one step, counted, not timed)."""
    with SavedActivations(model) as counted:
        run()
    return counted.peak_bytes


def plain_step(setup: Setup, batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    model, opt = setup

    def step() -> None:
        loss_of(model, *batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def accumulate_step(
    setup: Setup, batch: tuple[torch.Tensor, torch.Tensor], **options: object
) -> tuple[Callable[[], None], object]:
    model, opt = setup

    @accumulate(1, opt, model=model, **options)  # type: ignore[arg-type]
    def train_step(idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_of(model, idx, target)

    return (lambda: train_step(*batch)), train_step


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and 2 rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    depth, width, seq, rows, rounds = (3, 32, 16, 8, 2) if args.quick else (12, 256, 128, 32, args.rounds)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    names = [f"blocks.{i}" for i in range(depth)]

    plain = build(depth, width, seq)
    plain_bytes = peak_bytes(plain[0], plain_step(plain, batch))
    budget = plain_bytes // 2

    every = build(depth, width, seq)
    checkpoint_activations(every[0], "blocks.*")
    # micro-batches only: the largest halving of the batch whose activations fit the budget
    size = rows
    while True:
        micro = build(depth, width, seq)
        micro_step, _ = accumulate_step(micro, batch, micro_batch_size=size)
        if peak_bytes(micro[0], micro_step) <= budget or size == 1:
            break
        size = math.ceil(size / 2)
    # checkpointing only: the fewest blocks (in order) that make the whole batch fit
    for k in range(1, depth + 1):
        some = build(depth, width, seq)
        checkpoint_activations(some[0], names[:k])
        if peak_bytes(some[0], plain_step(some, batch)) <= budget:
            break
    planned = build(depth, width, seq)
    plan_step, train_step = accumulate_step(planned, batch, memory_budget=budget)
    while train_step.memory_plan is None:  # type: ignore[attr-defined]
        plan_step()  # the plan measures on these first calls (not timed)
    choice = train_step.memory_plan  # type: ignore[attr-defined]

    variants = {
        "plain": plain_step(plain, batch),
        "every block checkpointed": plain_step(every, batch),
        f"micro-batches only ({size} rows)": micro_step,
        f"checkpointing only ({k} blocks)": plain_step(some, batch),
        f"plan ({choice.micro_batch_size} rows, {len(choice.checkpointed)} blocks)": plan_step,
    }
    setups = [plain, every, micro, some, planned]
    kept = {name: peak_bytes(s[0], run) for (name, run), s in zip(variants.items(), setups, strict=True)}
    seconds = compare(variants, rounds=rounds, warmup=1)
    base_s, base_b = seconds["plain"], kept["plain"]
    print(
        f"memory levers: {depth}-block transformer, width {width}, sequence {seq}, batch {rows}, AdamW, "
        f"{torch.get_num_threads()} threads, median of {rounds} rounds; budget {budget / 2**20:.1f} MiB "
        f"(half of plain)"
    )
    print(f"| {'variant':<36} | activation bytes | vs plain | time per step | vs plain |")
    print(f"|{'-' * 38}|-----------------:|---------:|--------------:|---------:|")
    for name, s in seconds.items():
        print(
            f"| {name:<36} | {kept[name] / 2**20:12.1f} MiB | {kept[name] / base_b:7.2f}x | "
            f"{s * 1e3:10.0f} ms | {s / base_s:7.2f}x |"
        )
    every_s = seconds["every block checkpointed"] / base_s
    saved = 1 - kept["every block checkpointed"] / base_b
    single = min(seconds[f"micro-batches only ({size} rows)"], seconds[f"checkpointing only ({k} blocks)"])
    plan_name = next(n for n in seconds if n.startswith("plan"))
    plan_ratio = seconds[plan_name] / single
    print(f"plan: {choice}")
    print(
        f"memory: checkpointing saves {saved:.0%} of activation bytes at {every_s:.2f}x time; "
        f"plan {plan_ratio:.2f}x of the best single lever"
    )
    print(
        f"targets: saves >= 70%: {'met' if saved >= 0.7 else 'MISSED'}; time <= 1.4x: "
        f"{'met' if every_s <= 1.4 else 'MISSED'}; plan <= 1.00x of the best single lever: "
        f"{'met' if plan_ratio <= 1.0 else 'MISSED'}"
    )
    ratios = {name: s / base_s for name, s in seconds.items()}
    if not args.quick:
        print(f"chart: {save_chart(RESULTS / 'memory.png', 'memory levers (time vs plain)', ratios)}")
    return {"saved": saved, "time": every_s, "plan": plan_ratio}


if __name__ == "__main__":
    main()

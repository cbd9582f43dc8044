"""Benchmark: step time with ``mixed_precision()`` against fp32, on the example's CNN and a larger MLP.

Each variant runs the same training steps (forward, backward, optimizer step) in the same process, timed
round-robin. On the CPU: fp32 against ``mixed_precision()`` ("auto"), which must never be slower than fp32 by
more than noise (it picks bf16 only on CPUs with native bf16, and stays in fp32 elsewhere). On a GPU, when
one is available: fp32, bf16 and fp16 (with its GradScaler).

    python -m benchmarks.precision            # a minute or two
    python -m benchmarks.precision --quick    # a few seconds, for the smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._timing import RESULTS, compare, ratio_table, save_chart
from speedups.errors import SpeedupsWarning
from speedups.precision import mixed_precision

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"


def _small_cnn() -> nn.Module:
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SmallCNN()  # type: ignore[no-any-return]


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _variant(
    make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, amp: mixed_precision | None, steps: int
) -> Callable[[], None]:
    torch.manual_seed(0)
    model = make().to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            if amp is None:
                F.cross_entropy(model(x), y).backward()
                opt.step()
            else:
                with amp:
                    loss = F.cross_entropy(model(x), y)
                amp.backward(loss)
                amp.step(opt)
        if x.device.type == "cuda":
            torch.cuda.synchronize()

    return run


def _auto(device_type: str) -> tuple[mixed_precision, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SpeedupsWarning)
        amp = mixed_precision("auto", device_type=device_type)
    why = "; ".join(str(w.message).split(";")[0] for w in caught)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[amp.dtype]
    return amp, f"auto ({name})" + (f"  [{why}]" if why else "")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds: a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    steps = 2 if args.quick else 10
    width, batch = (128, 32) if args.quick else (1024, 256)

    g = torch.Generator().manual_seed(0)
    workloads: list[tuple[str, Callable[[], nn.Module], torch.Tensor, torch.Tensor]] = [
        ("example CNN, batch 64 of 1x8x8", _small_cnn,
         torch.rand(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)),
        (f"MLP {width}-{width}-{width}-10, batch {batch}", lambda: _mlp(width),
         torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)),
    ]  # fmt: skip
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    results: dict[str, dict[str, float]] = {}
    for device in devices:
        for title, make, x, y in workloads:
            x, y = x.to(device), y.to(device)
            amp, auto_name = _auto(device)
            variants = {"fp32": _variant(make, x, y, None, steps)}
            if device == "cuda":
                if torch.cuda.is_bf16_supported():
                    variants["bf16"] = _variant(
                        make, x, y, mixed_precision("bf16", device_type="cuda"), steps
                    )
                variants["fp16"] = _variant(make, x, y, mixed_precision("fp16", device_type="cuda"), steps)
            variants[auto_name.split("  ")[0]] = _variant(make, x, y, amp, steps)
            seconds = compare(variants, rounds=rounds, warmup=1)
            heading = (
                f"{device}: {title}, {steps} training steps per sample, median of {rounds} rounds, "
                f"{torch.get_num_threads()} CPU threads"
            )
            print(ratio_table(heading, seconds, "fp32"))
            if "[" in auto_name:
                print("  note: " + auto_name.split("  ", 1)[1])
            print()
            results[f"{device}: {title}"] = {k: v / seconds["fp32"] for k, v in seconds.items()}
    if not args.quick:
        flat = {
            f"{key.split(',')[0]} {name}": r for key, ratios in results.items() for name, r in ratios.items()
        }
        print(f"chart: {save_chart(RESULTS / 'precision.png', 'step time vs fp32', flat)}")
    return results


if __name__ == "__main__":
    main()

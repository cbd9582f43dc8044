"""The language-model benchmark: its corpus, model count and recipe exactly, and its output's form in quick
mode (not its timings)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from benchmarks import language_model as lm
from benchmarks._gpt import GPT
from benchmarks._text import TokenWindows, load_corpus, stdlib_files
from tests._bench import run_quick

LAST_LINE = re.compile(
    r"language_model: speedups (\d+\.\d\d)x faster than before, (\d+\.\d\d)x of expert, "
    r"accelerate (\d+\.\d\dx|n/a), fabric (\d+\.\d\dx|n/a); MFU after (\d+)% expert (\d+)%"
)


def test_the_corpus_is_the_stdlib_sources_split_by_file() -> None:
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    corpus = load_corpus(seq=64, val_windows=8)
    val = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 10 == 9)
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 10 != 9)
    assert (corpus.train_bytes, corpus.val_bytes) == (len(train), len(val))
    x, y = corpus.train[3]  # window 3 and the next byte of each
    assert x.dtype == torch.int64 and x.tolist() == list(train[3 * 64 : 4 * 64])
    assert y.tolist() == list(train[3 * 64 + 1 : 4 * 64 + 1])
    assert corpus.val_x.shape == (8, 64) and corpus.val_x[0].tolist() == list(val[:64])
    assert len(corpus.train) == (len(train) - 1) // 64
    assert len(TokenWindows(torch.arange(129, dtype=torch.uint8), 64)) == 2  # the last window needs y


def test_flops_per_token_is_six_n_plus_attention() -> None:
    model = GPT(depth=2, width=32, heads=2, vocab=256, seq=16)
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert linear_weights == 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 32 * 256
    assert model.flops_per_token() == 6 * linear_weights + 12 * 2 * 16 * 32
    assert model.flops_per_token(seq=32) == 6 * linear_weights + 12 * 2 * 32 * 32


def test_the_recipe_schedule_and_order() -> None:
    assert lm.schedule(0) == pytest.approx(1 / lm.WARMUP)
    assert lm.schedule(lm.WARMUP - 1) == pytest.approx(1.0)
    assert lm.schedule(lm.WARMUP) == pytest.approx(1.0)
    middle = (lm.WARMUP + lm.HORIZON) // 2
    assert lm.schedule(middle) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)), abs=1e-2)
    assert lm.schedule(lm.HORIZON) == pytest.approx(0.1) and lm.schedule(10 * lm.HORIZON) == pytest.approx(
        0.1
    )
    order = list(lm.Order(10, seed=1, needed=25))  # one permutation per round, cut to what is needed
    assert (
        len(order) == 25 and sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    )
    assert order == list(lm.Order(10, seed=1, needed=25)) and order != list(lm.Order(10, seed=2, needed=25))


def test_the_gpu_results_file_names_the_device_and_versions(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lm, "RESULTS", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    path = lm._write_gpu_results(torch.device("cuda"), "table\nlanguage_model: speedups 1.00x")
    text = path.read_text()
    assert path == tmp_path / "gpu.md" and "NVIDIA H100 80GB HBM3" in text
    assert f"torch {torch.__version__}" in text and f"CUDA {torch.version.cuda}" in text
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", text) and "```\ntable\nlanguage_model:" in text


@pytest.mark.slow  # a subprocess that trains five loops of a tiny GPT (about 20 s of CPU)
def test_quick_run_prints_every_row_mfu_and_the_headline_last(tmp_path) -> None:
    stdout = run_quick("language_model", "--backend", "aot_eager", timeout=400, results=tmp_path)
    lines = stdout.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    for row in ["before", "after", "expert", "accelerate", "fabric"]:
        assert any(re.match(rf"{row} +\d+\.\d s[ *] +\d+ +\d+ ms +\d+\.\d% ", line) for line in lines) or any(
            line.startswith(f"{row}: skipped: ") for line in lines
        ), (row, stdout)
    before = next(line for line in lines if line.startswith("before "))
    assert "1.00x" in before.split("%", 1)[1]  # before is the reference of its own ratio
    assert re.search(r"machine: matmul 2048x2048 bf16 \d+ GFLOP/s, fp32 \d+ GFLOP/s", stdout)
    # every loop trained the same model on the same data in the same order: the same loss in fp32 and bf16
    losses = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"  (\w+): .*final validation loss ([\d.]+)", stdout)
    }
    assert len(losses) >= 3 and max(losses.values()) - min(losses.values()) < 0.05, losses
    latest = (tmp_path / "latest.md").read_text()
    assert "## language_model\n\n```\n" in latest and lines[-1] in latest
    assert (tmp_path / "language_model.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--reps", "0"], "--reps 0: expected an int >= 1"),
        (["--max-steps", "-3"], "--max-steps -3: expected an int >= 1"),
        (["--threads", "0"], "--threads 0: expected an int >= 1"),
        (["--target", "0"], "--target 0.0: expected a validation loss > 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        lm.main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err

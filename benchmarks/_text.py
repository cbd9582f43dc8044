"""Text every machine with Python already has: the standard library's own source, as bytes.

The corpus is the running Python's top-level standard-library modules (``sysconfig``'s ``stdlib`` folder,
``*.py`` directly in it, sorted by name), one byte per token (vocabulary 256). Files are split, not bytes:
every tenth file in that order (the 10th, 20th, ...) is validation, the rest training, each side the files'
bytes joined in order. Python 3.11 has 168 such files, 4.7 MB (about 4.2 MB to train on); another Python
version has other files, so its losses differ a little.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset


def stdlib_files() -> list[Path]:
    """The corpus' files: ``*.py`` directly in the standard library's folder, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


class TokenWindows(Dataset):
    """Non-overlapping windows of a byte stream: item ``i`` is ``(x, y)``, two int64 tensors of shape
    ``(seq,)``, ``x = tokens[i*seq : (i+1)*seq]`` and ``y`` the same shifted by one (the next byte)."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq : (i + 1) * self.seq + 1].long()
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class Corpus:
    """The training windows and a fixed validation batch."""

    train: TokenWindows
    val_x: torch.Tensor  # (n, seq) int64: evenly spaced windows of the validation files
    val_y: torch.Tensor
    files: int
    train_bytes: int
    val_bytes: int


def load_corpus(seq: int, val_windows: int) -> Corpus:
    """Read the standard library's files and cut them as the module's docstring says."""
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no *.py files in {sysconfig.get_paths()['stdlib']!r}: no corpus to train on")
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % 10 == 9 else train).extend(path.read_bytes())
    train_t = torch.frombuffer(train, dtype=torch.uint8).clone()
    val_set = TokenWindows(torch.frombuffer(val, dtype=torch.uint8).clone(), seq)
    picks = torch.linspace(0, len(val_set) - 1, val_windows).long().tolist()
    xs, ys = zip(*(val_set[i] for i in picks), strict=True)
    return Corpus(
        TokenWindows(train_t, seq), torch.stack(xs), torch.stack(ys), len(files), len(train), len(val)
    )

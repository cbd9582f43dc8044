"""Tips compose without a central object: shard_model + @accumulate + mixed_precision + LossTracker,
checked against the same training written by hand in plain PyTorch."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from speedups import LossTracker, accumulate, mixed_precision, shard_model, to_device, unshard_model


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.decoder = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(16))  # on the root: used between the two shards

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x) * self.scale * mask)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(4, 6, generator=g), "mask": torch.ones(4, 16), "y": torch.randn(4, 1, generator=g)}
        for _ in range(7)  # windows of 2: three full windows and a short one
    ]


def test_shard_accumulate_bf16_and_tracker_equal_the_hand_written_loop() -> None:
    torch.manual_seed(0)
    reference = EncoderDecoder()
    model = copy.deepcopy(reference)
    batches = _data()

    # Plain PyTorch: autocast by hand, loss / 2 per micro-batch, step every 2, a short last window / 1.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for i, b in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(reference(b["x"], mask=b["mask"]).float(), b["y"])
        window = 2 if i < 6 else 1
        (loss / window).backward()
        ref_losses.append(loss.item())
        if i % 2 == 1 or i == len(batches) - 1:
            ref_opt.step()
            ref_opt.zero_grad()

    # speedups: the same training, sprinkled with the wrappers.
    model = shard_model(model, {"encoder": "cpu", "decoder": "cpu"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = LossTracker()

    @accumulate(2, optimizer)
    @mixed_precision("bf16", device_type="cpu")
    def train_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(batch["x"], mask=batch["mask"]).float(), batch["y"])

    for batch in train_step.epoch(batches):
        tracker.update(train_step(to_device(batch, "cpu")), n=len(batch["y"]))
    assert train_step.num_updates == 4
    unshard_model(model)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (
        tracker.compute() == torch.tensor(ref_losses).double().mean().item()
        or abs(tracker.compute() - sum(ref_losses) / len(ref_losses)) < 1e-6
    )

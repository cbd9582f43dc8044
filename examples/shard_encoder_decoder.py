"""Tip 8: an encoder on one device, a decoder on another, trained by a plain loop that moves nothing by hand.

The model has the parts that break hand-written model parallelism: a parameter on the root module used
between the encoder and the decoder, and a keyword ``mask`` that both need. ``shard_model`` moves inputs to
each submodule, brings outputs back, and returns the output on the batch's device.

Devices: ``cuda:0`` and ``cuda:1`` with two GPUs or more; ``cuda:0`` and the CPU with one; CPU devices
otherwise (or with ``--cpu``), where it shows the same code path. Run:
``python examples/shard_encoder_decoder.py --steps 200``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from speedups import shard_model, unshard_model


class Encoder(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)
        self.block = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: (B, T, d_in), mask: (B, T)
        h = self.proj(x)
        return (h + self.block(h)) * mask.unsqueeze(-1)


class Decoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:  # -> (B,)
        scores = self.block(h).squeeze(-1) * mask
        return scores.sum(1)


class EncoderDecoder(nn.Module):
    def __init__(self, d_in: int = 8, d: int = 64, max_len: int = 16) -> None:
        super().__init__()
        self.encoder = Encoder(d_in, d)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, d))  # root-level: lives on default_device
        self.decoder = Decoder(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x, mask=mask) + self.pos[: x.shape[1]]  # encoder output is back on pos's device
        return self.decoder(h, mask=mask)


def pick_devices(force_cpu: bool) -> dict[str, str]:
    count = 0 if force_cpu else torch.cuda.device_count()
    if count >= 2:
        print("2+ GPUs: encoder on cuda:0, decoder on cuda:1")
        return {"encoder": "cuda:0", "decoder": "cuda:1"}
    if count == 1:
        print("1 GPU: encoder on cuda:0, decoder on the CPU (two GPUs would put the decoder on cuda:1)")
        return {"encoder": "cuda:0", "decoder": "cpu"}
    print("fewer than 2 GPUs here: falling back to CPU devices (encoder and decoder both on cpu)")
    return {"encoder": "cpu", "decoder": "cpu"}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cpu", action="store_true", help="use CPU devices even when GPUs are present")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    # Target: the masked sum of the first feature, a task that needs the mask on both sides.
    x = torch.randn(1024, 16, 8)
    mask = (torch.rand(1024, 16) > 0.25).float()
    y = (x[..., 0] * mask).sum(1)

    model = shard_model(EncoderDecoder(), pick_devices(args.cpu))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)  # built after sharding

    for step in range(args.steps):
        idx = torch.randint(0, len(x), (64,))
        out = model(x[idx], mask=mask[idx])  # inputs stay on the CPU; out comes back there
        loss = F.mse_loss(out, y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step}: loss={loss.item():.4f}")  # a sync, only when printing

    # Checkpoints carry the unsharded keys: load them into a plain, single-device copy.
    plain = EncoderDecoder()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            plain(x[:32], mask[:32]), model(x[:32], mask=mask[:32]), rtol=1e-4, atol=1e-4
        )
    print("state_dict round trip: ok")
    unshard_model(model, "cpu")  # hooks removed, one device again
    return loss.item()


if __name__ == "__main__":
    main()

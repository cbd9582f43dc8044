"""An expert loop already written with speedups: the check must find nothing here."""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

from speedups import LossTracker, accumulate, fast_loader, mixed_precision, resolve_device, to_device

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
torch.manual_seed(0)
device = resolve_device(None)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
loader = fast_loader(data, 8, shuffle=True, num_workers=0)
model = to_device(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tracker = LossTracker()


@accumulate(2, optimizer, max_grad_norm=1.0)
@mixed_precision(device_type=device.type)
def train_step(x, y):
    return F.cross_entropy(model(x), y)


for epoch in range(2):
    for x, y in train_step.epoch(loader):
        tracker.update(train_step(*to_device((x, y), device)))
    print(f"epoch {epoch}: loss {tracker.end_epoch():.4f}")

"""An Accelerate-style script (tiny regression): prepare, accumulate, accelerator.backward."""
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(gradient_accumulation_steps=2)  # check: migration
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
dataset = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
dataloader = DataLoader(dataset, batch_size=8, shuffle=True)  # check: 1
model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
for epoch in range(1):
    for x, y in dataloader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)  # check: 7
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"loss={loss.item():.6f}")  # check: 5

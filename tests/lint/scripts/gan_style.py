"""A DCGAN-style loop (tiny, on random images): two optimizers, two backwards a step, losses logged."""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(2)
device = "cuda" if torch.cuda.is_available() else "cpu"
netG = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.Tanh()).to(device)
netD = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)).to(device)
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
dataloader = DataLoader(TensorDataset(torch.randn(48, 64)), batch_size=8, shuffle=True, num_workers=0)  # check: 1
G_losses, D_losses = [], []
for epoch in range(1):
    for i, (real,) in enumerate(dataloader):
        real = real.to(device)  # check: 6
        b_size = real.size(0)
        netD.zero_grad()
        label = torch.full((b_size, 1), 1.0, device=device)
        errD_real = criterion(netD(real), label)
        errD_real.backward()  # check: 7
        noise = torch.randn(b_size, 8, device=device)
        fake = netG(noise)
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()), label)
        errD_fake.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake), label)
        errG.backward()
        optimizerG.step()
        G_losses.append(errG.item())  # check: 5
        D_losses.append(errD.item())  # check: 5
        print(f"loss={errD.item() + errG.item():.6f}")  # check: 5

"""An MNIST-style script as tutorials write it (synthetic 28x28 digits: nothing is downloaded)."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return self.fc1(torch.flatten(x, 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    train_loader = DataLoader(data, batch_size=8, shuffle=True)  # check: 1
    model = Net().to(device)  # check: fast_kernels
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    step = 0
    for epoch in range(2):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)  # check: 6
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()  # check: 7
            optimizer.step()
            losses.append(loss)  # check: 5
            print(f"loss={loss.item():.6f}")  # check: 5
            step += 1
            if step == args.steps:
                return
    torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == "__main__":
    main()

"""An ImageNet-style main.py (tiny convnet, random images): DDP or DataParallel, a sampler, meters, and a
save_checkpoint helper; runs on one CPU process for a few steps."""
import argparse
import os

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--gpu", type=int, default=None)


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n


def save_checkpoint(state, filename="checkpoint.pth.tar"):
    torch.save(state, filename)  # check: checkpoints


def main():
    args = parser.parse_args()
    args.distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10))
    if args.distributed:
        dist.init_process_group(backend="nccl")
        model.cuda(args.gpu)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    elif torch.cuda.device_count() > 1:
        model = torch.nn.DataParallel(model).cuda()  # check: 9
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    cudnn.benchmark = True
    train_dataset = torch.utils.data.TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,)))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset) if args.distributed else None
    train_loader = torch.utils.data.DataLoader(  # check: 1
        train_dataset, batch_size=8, shuffle=(train_sampler is None), num_workers=args.workers,
        pin_memory=True, sampler=train_sampler)
    for epoch in range(2):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        losses = AverageMeter()
        model.train()
        for i, (images, target) in enumerate(train_loader):
            if torch.cuda.is_available():
                images = images.cuda(args.gpu, non_blocking=True)
                target = target.cuda(args.gpu, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            losses.update(loss.item(), images.size(0))  # check: 5
            optimizer.zero_grad()
            loss.backward()  # check: 7
            optimizer.step()
            print(f"loss={loss.item():.6f}")  # check: 5
            if epoch * len(train_loader) + i + 1 == args.steps:
                return
        if not args.distributed or dist.get_rank() == 0:
            save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(),
                             "optimizer": optimizer.state_dict()})


if __name__ == "__main__":
    main()

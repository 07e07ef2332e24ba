"""MNIST-shaped classification (seed 003's BasicNet) on synthetic data: no download needed.

    python examples/classification.py --nprocs 2          # 2 CPU processes
    torchrun --standalone --nproc_per_node 2 examples/classification.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer


class BasicNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n: int, seed: int) -> TensorDataset:
    """28x28 images whose class is drawn as a bright horizontal band: learnable in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.3
    for i, label in enumerate(labels.tolist()):
        images[i, 0, 2 + 2 * label: 4 + 2 * label, :] += 1.0
    return TensorDataset((images - 0.1307) / 0.3081, labels)


def nll(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, dict]:
    data, target = batch
    output = model(data)
    loss = F.nll_loss(output, target)
    accuracy = (output.argmax(dim=1) == target).float().mean()
    return loss, {"accuracy": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    args = parser.parse_args()
    train = DataLoader(synthetic_mnist(args.samples, 0), batch_size=64, shuffle=True)
    test = DataLoader(synthetic_mnist(256, 1), batch_size=64)
    torch.manual_seed(0)
    model = BasicNet()
    config = TrainConfig(nprocs=args.nprocs, compute_setup="cpu", max_iter=args.epochs, print_every=1, val_every=1,
                         seed=0, root_folder="runs/classification")
    trainer = Trainer(model, optim.AdamW(model.parameters(), lr=1e-3), config, loss_fn=nll,
                      val_dataloader=test)
    trainer.fit(train)
    print("test:", {k: round(v, 4) for k, v in trainer.test(test).items()})


if __name__ == "__main__":
    main()

"""A Trainer job that takes its time (0.25 s a step, 400 steps), for `status` to read its progress and ETA."""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer


def slow_mse(model, batch):
    time.sleep(0.25)
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(800, 4), torch.randn(800, 1)), batch_size=2)
    model = nn.Linear(4, 1)
    cfg = TrainConfig(compute_setup="cpu", max_steps=400, log_every_n_steps=4, root_folder="runs")
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=slow_mse).fit(data)

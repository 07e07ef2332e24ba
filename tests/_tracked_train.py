"""A run for tests/test_run_identity.py, killed with SIGKILL at random moments and resumed: 1 process, 160 steps,
a line every 5 steps, a checkpoint every 10, ``python _tracked_train.py FOLDER TOOL``."""

import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer


def loss_fn(model, batch):
    time.sleep(0.04)  # slow enough that a kill lands during a step, a checkpoint or a metrics write
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss, {"mse": loss.detach()}


if __name__ == "__main__":
    folder, tool = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(160, 4, generator=g), torch.randn(160, 1, generator=g)),
                      batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = TrainConfig(compute_setup="cpu", max_steps=160, max_iter=100, log_folder=folder, tracking_tool=tool,
                         resume="auto", seed=0, log_every_n_steps=5, checkpoint_every_n_steps=10, verbose=True,
                         plot_every=0, hyperparams={"lr": 0.05})
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), config, loss_fn=loss_fn).fit(data)

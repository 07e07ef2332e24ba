"""Run by test_hang.py inside generated scripts: training that gets stuck on one rank (MODE=stuck), or that keeps
going slowly so `trainstack debug` can look at it (MODE=slow)."""

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["PROBE_OUT"])


def stuck_in_user_code():
    while True:
        time.sleep(1)


def loss_fn(model, batch):
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    if os.environ.get("MODE") == "stuck" and rank == 1 and loss_fn.calls == 4:
        stuck_in_user_code()
    loss_fn.calls += 1
    if os.environ.get("MODE") == "slow":
        time.sleep(0.2)
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


loss_fn.calls = 0


def started(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        (OUT / "started").write_text(str(trainer.global_step))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g)),
                      batch_size=4)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = TrainConfig(nprocs=int(sys.argv[1]) if len(sys.argv) > 1 else 1, compute_setup="cpu", max_iter=1000,
                      verbose=False, log_folder=OUT / "run",
                      callbacks=[Callback(on="train_batch_end", called_every=2, callback=started)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=loss_fn).fit(data)

"""Trained by test_node_health.py: 4 ranks on 2 nodes, an MLP whose forward is real compute (so CPU contention on
one node shows in that node's ranks' forward time), a checkpoint every 10 steps, resume='auto'; every rank leaves
its pid (by host); rank 0 writes the step it reached. Trains until ``PACE_STEPS`` steps (default: many)."""

import os
import socket
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["PROBE_OUT"])


def mark(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        (OUT / "step.tmp").write_text(str(trainer.global_step))
        os.replace(OUT / "step.tmp", OUT / "step")


def leave_pid(trainer, config, writer):
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    (OUT / "pids").mkdir(exist_ok=True)
    (OUT / "pids" / f"{host}-{trainer.accelerator.rank}").write_text(str(os.getpid()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(2048, 128, generator=g), torch.randn(2048, 1, generator=g)),
                      batch_size=64, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1))
    cfg = TrainConfig(max_steps=int(os.environ.get("PACE_STEPS", "100000")), max_iter=1000, seed=1,
                      checkpoint_every_n_steps=10, resume="auto", verbose=True, print_every=0,
                      root_folder=OUT / "runs", backend="gloo", compute_setup="cpu",
                      callbacks=[Callback(on="train_batch_end", callback=mark),
                                 Callback(on="train_start", callback=leave_pid)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg).fit(data)

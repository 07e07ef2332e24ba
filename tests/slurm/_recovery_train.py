"""Trained by test_recovery.py: 4 ranks on 2 nodes, slow enough to be killed mid-epoch, a checkpoint every 5
steps, resume='auto'; every rank leaves its pid (by host) so the test can kill it or its node; rank 0 writes the
step it reached and the final parameters. Under the spawn launcher each node's task spawns its share of the 4
processes (TRAINSTACK_NPROCS, set by the job script)."""

import os
import socket
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["PROBE_OUT"])


def slow(trainer, config, writer):
    """Slow until the fault (the first run), quick after it: the test waits for the end."""
    first = os.environ.get("TRAINSTACK_ATTEMPT", "0") == "0" or os.environ.get("SLOW_ALWAYS") == "1"
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")) if first else 0.02)
    if trainer.accelerator.rank == 0:
        (OUT / "step.tmp").write_text(str(trainer.global_step))
        os.replace(OUT / "step.tmp", OUT / "step")


def leave_pid(trainer, config, writer):
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    pids = OUT / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"{host}-{trainer.accelerator.rank}").write_text(f"{os.getpid()} {os.environ.get('TRAINSTACK_STEP')}")


def save_final(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        torch.save(trainer.model.state_dict(), OUT / "final.pt")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(240, 4, generator=g), torch.randn(240, 1, generator=g)),
                      batch_size=4, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    cfg = TrainConfig(max_iter=4, seed=1, checkpoint_every_n_steps=5, resume="auto", verbose=False,
                      memory_checkpoint_every_n_steps=int(os.environ.get("MEMORY_EVERY", "0")),
                      root_folder=OUT / "runs", backend="gloo", compute_setup="cpu",
                      callbacks=[Callback(on="train_batch_end", callback=slow),
                                 Callback(on="train_start", callback=leave_pid),
                                 Callback(on="train_end", callback=save_final)])
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg)
    trainer.fit(data)

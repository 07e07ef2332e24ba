"""Program run by the generated scripts in the Slurm tests: a short Trainer.fit, then a report per rank."""

import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer


def report(trainer, config, writer):
    acc = trainer.accelerator
    out = Path(os.environ["PROBE_OUT"])
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    record = {"rank": acc.rank, "world": acc.world_size, "node": node,
              "epoch": trainer.current_epoch, "param_sum": float(sum(p.sum() for p in trainer.model.parameters())),
              "argv": sys.argv[1:], "note": os.environ.get("NOTE"), "restart": os.environ.get("SLURM_RESTART_COUNT")}
    (out / f"rank{acc.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    nprocs = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8,
                      shuffle=True)
    torch.manual_seed(int(os.environ.get("SLURM_PROCID", "0")))  # per-task init: DDP must make them equal
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = TrainConfig(nprocs=nprocs, compute_setup="cpu", max_iter=2, verbose=False,
                      log_folder=Path(os.environ["PROBE_OUT"]) / "run",
                      callbacks=[Callback(on="train_end", callback=report)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(data)

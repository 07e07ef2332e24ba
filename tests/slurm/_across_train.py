"""A run that moves between clusters (tests/slurm/test_clusters.py): its checkpoint store comes from the environment
(TRAINSTACK_CHECKPOINT_STORE, set by trainstack submit --cluster ... --store), its run folder is the cluster's own
(OUT_ROOT/<TRAINSTACK_CLUSTER>: clusters share no file system), checkpoints every 2 steps, STEP_SLEEP per step.
Rank 0 saves the final parameters to OUT_ROOT/<cluster>/final.pt."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer


def pace(trainer, *_args) -> None:
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))


def main() -> None:
    here = Path(os.environ["OUT_ROOT"]) / os.environ.get("TRAINSTACK_CLUSTER", "local")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = TrainConfig(max_iter=2, log_folder=here / "run", resume="auto", seed=1, compute_setup="cpu",
                         backend="gloo", checkpoint_every_n_steps=2, log_every_n_steps=1,
                         callbacks=[Callback(on="train_batch_end", callback=pace)])
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-2), config, loss_fn="mse").fit(loader)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        torch.save({k: v.detach().clone() for k, v in trained.state_dict().items()}, here / "final.pt")


if __name__ == "__main__":
    main()

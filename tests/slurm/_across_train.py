"""A run that moves between clusters (tests/slurm/test_across_clusters.py): its checkpoint store comes from the
environment (TRAINSTACK_CHECKPOINT_STORE, set by trainstack submit --cluster ... --store), its run folder is the
cluster's own (OUT_ROOT/<TRAINSTACK_CLUSTER>: clusters share no file system), checkpoints every 2 steps, STEP_SLEEP
per step. Every rank appends the sample ids of each batch it trains on to OUT_ROOT/<cluster>/ids-rank<R>.jsonl;
rank 0 saves the final parameters to OUT_ROOT/<cluster>/final.pt."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

HERE = Path(os.environ["OUT_ROOT"]) / os.environ.get("TRAINSTACK_CLUSTER", "local")
RANK = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
N = 96


def pace(trainer, *_args) -> None:
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))


def recording_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y, ids = batch
    if model.training:
        with open(HERE / f"ids-rank{RANK}.jsonl", "a") as fh:
            fh.write(json.dumps([int(i) for i in ids.reshape(-1).tolist()]) + "\n")
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    ids = torch.arange(N, dtype=torch.float32).reshape(-1, 1)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True), ids), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    config = TrainConfig(max_iter=2, log_folder=HERE / "run", resume="auto", seed=1, compute_setup="cpu",
                         backend="gloo", checkpoint_every_n_steps=2, log_every_n_steps=1,
                         callbacks=[Callback(on="train_batch_end", callback=pace)])
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-2), config,
                         loss_fn=recording_loss).fit(loader)
    if RANK == 0:
        torch.save({k: v.detach().clone() for k, v in trained.state_dict().items()}, HERE / "final.pt")


if __name__ == "__main__":
    main()

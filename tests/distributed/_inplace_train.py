"""Trained by test_inplace.py as one srun task per rank would run it (the test sets the Slurm step's variables and
plays the allocation driver): 2 ranks, a checkpoint every 4 steps; rank KILL_RANK SIGKILLs itself after step
KILL_STEP in job step 0. Each rank leaves its pid and job step per fit start (pids/<rank>); rank 0 saves the final
parameters."""

import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["INPLACE_OUT"])


def fault(trainer, config, writer):
    if os.environ.get("TRAINSTACK_STEP") == "0" and trainer.accelerator.rank == int(os.environ.get("KILL_RANK", -1)) \
            and trainer.global_step == int(os.environ.get("KILL_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)


def leave_pid(trainer, config, writer):
    with open(OUT / f"pid-{trainer.accelerator.rank}", "a") as f:
        f.write(f"{os.getpid()} {os.environ.get('TRAINSTACK_STEP')}\n")


def save_final(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        torch.save(trainer.model.state_dict(), OUT / "final.pt")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)), batch_size=4,
                      shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    cfg = TrainConfig(max_iter=2, seed=3, checkpoint_every_n_steps=4, resume="auto", verbose=False,
                      root_folder=OUT / "runs", backend="gloo", compute_setup="cpu",
                      gradient_accumulation_steps=int(os.environ.get("ACCUMULATE", "1")),
                      callbacks=[Callback(on="optimizer_step", callback=fault),
                                 Callback(on="train_start", callback=leave_pid),
                                 Callback(on="train_end", callback=save_final)])
    Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(data)

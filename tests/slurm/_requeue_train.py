"""Trained by test_requeue.py: slow enough to be signalled mid-run; resumes with resume='auto' after requeue."""

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["PROBE_OUT"])


def slow(trainer, config, writer):
    time.sleep(0.04)


def progress(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        (OUT / "epochs").write_text(str(trainer.current_epoch))


def mark_start(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        with open(OUT / "starts", "a") as fh:
            fh.write(f"{time.time()} {trainer.global_step} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")


def save_final(trainer, config, writer):
    if trainer.accelerator.rank == 0:
        torch.save(trainer.model.state_dict(), OUT / "final.pt")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)), batch_size=4,
                      shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    cfg = TrainConfig(max_iter=10, seed=1, checkpoint_every=2, resume="auto", verbose=False, root_folder=OUT,
                      stop_check_every=5,
                      callbacks=[Callback(on="train_batch_end", callback=slow),
                                 Callback(on="train_epoch_end", callback=progress),
                                 Callback(on="train_start", callback=mark_start),
                                 Callback(on="train_end", callback=save_final)])
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg)
    trainer.fit(data)
    after = float(os.environ.get("AFTER_FIT_SLEEP", "0"))  # the script's own code after fit(), e.g. generation
    if after and trainer.is_global_zero:
        (OUT / "fit-done").write_text(os.environ.get("SLURM_RESTART_COUNT", "0"))
    time.sleep(after)
    if trainer.is_global_zero:
        (OUT / f"after-fit-{os.environ.get('SLURM_RESTART_COUNT', '0')}").write_text("done")

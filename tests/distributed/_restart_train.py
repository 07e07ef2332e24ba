"""Trained under `torchrun --max-restarts=1` by test_fault_tolerance.py: rank 1 is SIGKILLed once, mid-run."""

import os
import signal
import sys
import time
from pathlib import Path

import _toy
import torch

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(sys.argv[1])
KILL = sys.argv[2] == "kill"


def maybe_kill(trainer, config, writer):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if KILL and first_attempt and trainer.accelerator.rank == 1 and trainer.global_step == 30:
        (OUT / "killed_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


def mark_start(trainer, config, writer):
    if trainer.accelerator.rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        (OUT / "resumed_at").write_text(f"{time.time()} {trainer.global_step}")


if __name__ == "__main__":
    model = _toy.model()
    cfg = TrainConfig(max_iter=6, seed=1, checkpoint_every=1, resume="auto", verbose=False, log_folder=OUT / "run",
                      callbacks=[Callback(on="train_batch_end", callback=maybe_kill),
                                 Callback(on="train_start", callback=mark_start),
                                 Callback(on="train_end", callback=_toy.final_saver(OUT))])
    Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(_toy.data())

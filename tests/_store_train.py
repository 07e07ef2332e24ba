"""Trained by test_checkpoint_store.py under torchrun: durable checkpoints every EVERY steps committed to the
checkpoint store STORE (a URL), STEPS steps in all; DIE_UPLOADING=<step>: rank 0 is killed (os._exit) while it
uploads that step's checkpoint, after its objects and before its marker; FREEZE_AT=<step> with FREEZE_PID: rank 0
stops the store's server (SIGSTOP) at that step, STEP_SLEEP slows each step. Every rank's final local state is
saved for a comparison."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack._checkpoint import store as _store
from trainstack.callbacks import Callback

OUT = Path(sys.argv[1])
RANK = int(os.environ.get("RANK", "0"))


def die_uploading(step: int) -> None:
    original = _store.Store.upload

    def dying(self, local: Path, lease=None) -> None:
        if local.name.endswith(f"-s{step:09d}") or local.name.endswith(f"-s{step:09d}.pt"):
            self.fs.put(str(local), self._path(local.name), recursive=local.is_dir())  # the objects, no marker
            os._exit(9)
        original(self, local, lease)

    _store.Store.upload = dying


def pace(trainer, *_args) -> None:
    """STEP_SLEEP per step; FREEZE_AT: the store's server stops answering at that step (rank 0 sends SIGSTOP)."""
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    if RANK == 0 and os.environ.get("FREEZE_AT") == str(trainer.global_step):
        os.kill(int(os.environ["FREEZE_PID"]), signal.SIGSTOP)
        print(f"froze the store at step {trainer.global_step}", flush=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if os.environ.get("DIE_UPLOADING"):
        die_uploading(int(os.environ["DIE_UPLOADING"]))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    config = TrainConfig(max_iter=100, max_steps=int(os.environ.get("STEPS", "12")), log_folder=OUT / "run",
                         resume="auto", seed=1, strategy=os.environ.get("STRATEGY", "ddp"),
                         checkpoint_every_n_steps=int(os.environ.get("EVERY", "4")), log_every_n_steps=0,
                         checkpoint_format=os.environ.get("FORMAT", "auto"),
                         async_checkpoint=bool(os.environ.get("ASYNC")),
                         keep_last_checkpoints=int(os.environ["KEEP"]) if os.environ.get("KEEP") else None,
                         checkpoint_store=os.environ["STORE"],
                         callbacks=[Callback(on="train_batch_end", callback=pace)])
    trained, _ = Trainer(model, torch.optim.AdamW(model.parameters(), 1e-2), config, loss_fn="mse").fit(loader)
    local = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trained.state_dict().items()}
    torch.save(local, OUT / f"final-rank{RANK}.pt")


if __name__ == "__main__":
    main()

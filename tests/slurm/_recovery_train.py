"""Trained by test_recovery.py: 4 ranks on 2 nodes, slow enough to be killed mid-epoch, a checkpoint every 5
steps, resume='auto'; every rank leaves its pid (by host) so the test can kill it or its node; rank 0 writes the
step it reached and the final parameters; with RECORD_IDS=1 every rank records the samples of each optimizer step
(ids/<job step>-rank<r>.jsonl); STOP_AT=N stops the run gracefully at step N (a reference's checkpoint). Every
optimizer step's random streams (dropout) derive from the seed, the rank and the step (``seed_every_step``): a rank
started beside survivors draws what the killed one would have. Under the
spawn launcher each node's task spawns its share of the 4 processes (TRAINSTACK_NPROCS, set by the job script).
STRATEGY=hsdp: one replica group per node, each Linear a block; the final parameters gathered whole."""

import json
import os
import socket
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["PROBE_OUT"])
SEEN: list[int] = []  # the sample ids of this rank since its last optimizer step


def loss(model, batch):
    x, y, ids = batch
    SEEN.extend(ids.tolist())
    return nn.functional.mse_loss(model(x), y)


def record_ids(trainer, config, writer):
    """This rank's samples of the optimizer step just taken, by job step (a redone step's records are told apart)."""
    if os.environ.get("RECORD_IDS") == "1":
        folder = OUT / "ids"
        folder.mkdir(exist_ok=True)
        name = f"{os.environ.get('TRAINSTACK_STEP', 'local')}-{os.environ.get('TRAINSTACK_ATTEMPT', '0')}"
        with open(folder / f"{name}-rank{trainer.accelerator.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "epoch": trainer.current_epoch, "ids": SEEN}) + "\n")
    SEEN.clear()
    stop_at = os.environ.get("STOP_AT")
    if stop_at and trainer.global_step == int(stop_at):
        (OUT / "STOP").touch()


def slow(trainer, config, writer):
    """Slow until the fault (the first run), quick after it: the test waits for the end."""
    first = os.environ.get("TRAINSTACK_ATTEMPT", "0") == "0" or os.environ.get("SLOW_ALWAYS") == "1"
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")) if first else 0.02)
    if trainer.accelerator.rank == 0:
        (OUT / "step.tmp").write_text(str(trainer.global_step))
        os.replace(OUT / "step.tmp", OUT / "step")


def leave_pid(trainer, config, writer):
    SEEN.clear()  # a rank restarted in place keeps its process: the samples of its interrupted step are not a step's
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    pids = OUT / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"{host}-{trainer.accelerator.rank}").write_text(f"{os.getpid()} {os.environ.get('TRAINSTACK_STEP')}")


def save_final(trainer, config, writer):
    state = trainer.model.state_dict()
    if config.strategy == "hsdp":  # every rank: the shards gathered whole
        from trainstack._runtime.fsdp import full_state

        state, _ = full_state(trainer.model, None)
    if trainer.accelerator.rank == 0:
        torch.save(state, OUT / "final.pt")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(240, 4, generator=g), torch.randn(240, 1, generator=g),
                                    torch.arange(240)), batch_size=4, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    cfg = TrainConfig(max_iter=4, seed=1, seed_every_step=True, checkpoint_every_n_steps=5, resume="auto",
                      verbose=False,
                      memory_checkpoint_every_n_steps=int(os.environ.get("MEMORY_EVERY", "0")),
                      root_folder=OUT / "runs", backend="gloo", compute_setup="cpu",
                      **({"strategy": "hsdp", "fsdp_blocks": ("Linear",)} if os.environ.get("STRATEGY") == "hsdp"
                         else {}),
                      # STOP_AT (a reference run, outside Slurm): its own stop file, checked every step; under the
                      # driver the job's stop file (TRAINSTACK_STOP_FILE) carries the graceful stops
                      **({"stop_file": OUT / "STOP", "stop_check_every": 1} if os.environ.get("STOP_AT") else {}),
                      callbacks=[Callback(on="train_batch_end", callback=slow),
                                 Callback(on="optimizer_step", callback=record_ids),
                                 Callback(on="train_start", callback=leave_pid),
                                 Callback(on="train_end", callback=save_final)])
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg, loss_fn=loss)
    trainer.fit(data)

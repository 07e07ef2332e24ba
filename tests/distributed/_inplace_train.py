"""Trained by test_inplace.py as one srun task per rank would run it (the test sets the Slurm step's variables and
plays the allocation driver): 2 ranks, a checkpoint every 4 steps; rank KILL_RANK SIGKILLs itself after step
KILL_STEP in job step 0; every optimizer step's random streams (dropout) derive from the seed, the rank and the
step (``seed_every_step``), so the new rank draws what the killed one would have. Each rank leaves its pid and job
step per fit start (pids/<rank>); rank 0 saves the final parameters. STRATEGY=hsdp: 4 ranks as 2 replica groups x
2 shards, each Linear a block (the whole parameters gathered for the final save)."""

import os
import signal
from pathlib import Path

import _toy
import torch

from trainstack import Callback, TrainConfig, Trainer

OUT = Path(os.environ["INPLACE_OUT"])


def fault(trainer, config, writer):
    if os.environ.get("TRAINSTACK_STEP") == "0" and trainer.accelerator.rank == int(os.environ.get("KILL_RANK", -1)) \
            and trainer.global_step == int(os.environ.get("KILL_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)


def leave_pid(trainer, config, writer):
    with open(OUT / f"pid-{trainer.accelerator.rank}", "a") as f:
        f.write(f"{os.getpid()} {os.environ.get('TRAINSTACK_STEP')}\n")


def save_whole(trainer, config, writer):
    """The final parameters gathered whole (collective: every rank), saved by rank 0."""
    from trainstack._runtime.fsdp import full_state

    state, _ = full_state(trainer.model, None)
    if trainer.accelerator.rank == 0:
        torch.save(state, OUT / "final.pt")


if __name__ == "__main__":
    model = _toy.model(16)
    sharded = os.environ.get("STRATEGY") == "hsdp"
    cfg = TrainConfig(max_iter=2, seed=3, seed_every_step=True, checkpoint_every_n_steps=4, resume="auto",
                      verbose=False,
                      root_folder=OUT / "runs", backend="gloo", compute_setup="cpu",
                      gradient_accumulation_steps=int(os.environ.get("ACCUMULATE", "1")),
                      **({"strategy": "hsdp", "hsdp_replicas": 2, "fsdp_blocks": ("Linear",)} if sharded else {}),
                      callbacks=[Callback(on="optimizer_step", callback=fault),
                                 Callback(on="train_start", callback=leave_pid),
                                 Callback(on="train_end", callback=save_whole if sharded else _toy.final_saver(OUT))])
    Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(_toy.data())

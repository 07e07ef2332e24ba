"""Run under torchrun by bench/restart.py: trains, stops or dies at a given step, and when started again records
the phases of its resume in <out>/phases-<attempt>.json (rank 0).

    torchrun ... _restart_worker.py OUT stop|kill|resume
"""

import time

T_IMPORT_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainstack import Callback, TrainConfig, Trainer  # noqa: E402
from trainstack.checkpoint import Checkpointer  # noqa: E402

T_IMPORTED = time.time()
OUT, MODE = Path(sys.argv[1]), sys.argv[2]
AT_STEP = 600  # mid-epoch: 3125 steps per epoch per rank
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
PHASES: dict[str, float] = {"import_start": T_IMPORT_START, "imported": T_IMPORTED}


def _process_start() -> float:
    """Wall time this process started (from /proc: before the interpreter ran a line)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _timed(owner, name, key):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[key + "_start"], PHASES[key] = start, time.time()
    setattr(owner, name, wrapper)


_timed(dist, "init_process_group", "rendezvous")
_timed(Checkpointer, "restore", "checkpoint_load")


def on_batch(trainer, config, writer):
    rank, step = trainer.accelerator.rank, trainer.global_step
    if "first_step" not in PHASES:
        PHASES["first_step"], PHASES["first_step_no"] = time.time(), step
        if rank == 0:
            PHASES["process_start"] = _process_start()
            (OUT / f"phases-{MODE}-{ATTEMPT}.json").write_text(json.dumps(PHASES))
    if step == AT_STEP and ATTEMPT == "0" and rank == 1:
        if MODE == "kill":
            (OUT / "failed_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        elif MODE == "stop":
            os.kill(os.getpid(), signal.SIGUSR2)  # a graceful stop: every rank agrees, checkpoints, exits 0


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(200_000, 16, generator=g), torch.randn(200_000, 1, generator=g)),
                      batch_size=32, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    # stop/resume: one epoch, stopped mid-epoch at AT_STEP (the resume jumps to that global sample);
    # kill: epochs of 400 batches with a checkpoint each, rank 1 dies in the second (torchrun restarts the group)
    kill = MODE == "kill"
    cfg = TrainConfig(max_iter=2 if kill else 1, seed=1, resume="auto", verbose=False, log_folder=OUT / "run",
                      stop_check_every=1, max_batches=400 if kill else AT_STEP + 20, checkpoint_every=1 if kill else 0,
                      callbacks=[Callback(on="train_batch_end", callback=on_batch)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg).fit(data)

"""Trained by test_memory_checkpoints.py under torchrun: memory checkpoints every MEM steps, ranks grouped into
"nodes" of NODE_SIZE (TRAINSTACK_NODE_NAME), durable checkpoints every DURABLE steps (CHECKPOINT_FORMAT; ASYNC:
in the background), faults at the steps FAULTS names on rank CRASH_RANK (default 3), and every rank's final local
state saved for a bitwise comparison.

FAULTS, ``step:kind,...``, each once: ``exit`` (the process dies), ``node`` (node n1 is lost with its memory: its
folder removed), ``both`` (every node's memory lost), ``corrupt`` (rank 1's newest own copy truncated, then the
process dies), ``fill`` / ``unfill`` (rank 0 fills the memory file system with a file, then removes it: the saves
between fail and training goes on). ROOT_FOLDER=1: the run folder is chosen under ``OUT/runs`` (no log_folder).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
os.environ["TRAINSTACK_NODE_NAME"] = f"n{RANK // int(os.environ.get('NODE_SIZE', '2'))}"

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from trainstack import TrainConfig, Trainer  # noqa: E402
from trainstack.callbacks import Callback  # noqa: E402

OUT = Path(sys.argv[1])


def memory_folders() -> list[Path]:
    root = Path(os.environ.get("TRAINSTACK_MEMORY_DIR", "/dev/shm")) / f"trainstack-{os.getuid()}"
    return sorted(root.glob("job-*"))


def fault(trainer, *_args) -> None:
    step = trainer.global_step
    if os.environ.get("SLOW"):
        time.sleep(float(os.environ["SLOW"]))  # steps longer than a memory round: the kill moments are spread
    if RANK == 0:
        with open(OUT / "progress", "a") as fh:
            fh.write(f"step {step}\n")
    faults = dict(item.split(":") for item in os.environ.get("FAULTS", "").split(",") if item)
    mode = faults.get(str(step))
    if mode in ("fill", "unfill") and RANK == 0:
        filler = Path(os.environ["TRAINSTACK_MEMORY_DIR"]) / "filler"
        if mode == "fill":
            trainer.run.memory.wait()  # the set of the step before is complete
            # unbuffered: a buffered file's close would flush what the full disk refused and raise on this rank
            # (a crash of the test's own making, seen once under load)
            with open(filler, "wb", buffering=0) as fh:
                try:
                    while True:
                        fh.write(b"\0" * (1 << 16))
                except OSError:
                    pass
        else:
            filler.unlink(missing_ok=True)
        return
    marker = OUT / f"faulted-{step}"
    if mode is None or mode == "midsave" or RANK != int(os.environ.get("CRASH_RANK", "3")) or marker.exists():
        return
    marker.touch()
    run = trainer.run
    if run is not None and run.memory is not None:
        run.memory.wait()  # the last save's set is complete on every rank (its round ends with an all-reduce)
    for job in memory_folders():
        if mode == "node":
            shutil.rmtree(job / "n1", ignore_errors=True)
        elif mode == "both":
            shutil.rmtree(job, ignore_errors=True)
        elif mode == "corrupt":
            newest = sorted((job / "n0").glob("r00001-s*.pt"))[-1]
            newest.write_bytes(newest.read_bytes()[:100])
    os._exit(9)


def die_inside_a_save(step: int) -> None:
    """The ``midsave`` fault: rank CRASH_RANK dies inside the writer thread at the memory save of ``step``, before
    its copy is written anywhere -- that step's set is left incomplete."""
    from trainstack._checkpoint.memory import MemoryCheckpoints

    original = MemoryCheckpoints._round

    def dying(self, at: int, copy) -> None:
        marker = OUT / f"faulted-{at}"
        if at == step and RANK == int(os.environ.get("CRASH_RANK", "3")) and not marker.exists():
            marker.touch()
            os._exit(9)
        original(self, at, copy)

    MemoryCheckpoints._round = dying


def started(trainer, *_args) -> None:
    if RANK == 0:
        with open(OUT / "progress", "a") as fh:
            fh.write(f"start {trainer.global_step}\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for item in os.environ.get("FAULTS", "").split(","):
        if item.endswith(":midsave"):
            die_inside_a_save(int(item.split(":")[0]))
    (OUT / "pids").mkdir(exist_ok=True)
    (OUT / "pids" / f"rank-{RANK}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(384, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-2)
    where = {"root_folder": OUT / "runs"} if os.environ.get("ROOT_FOLDER") else {"log_folder": OUT / "run"}
    config = TrainConfig(max_iter=100, max_steps=int(os.environ.get("STEPS", "20")), **where,
                         resume="auto", seed=1, strategy=os.environ.get("STRATEGY", "ddp"),
                         memory_checkpoint_every_n_steps=int(os.environ.get("MEM", "3")),
                         checkpoint_every_n_steps=int(os.environ.get("DURABLE", "0")),
                         log_every_n_steps=int(os.environ.get("LOG_EVERY", "0")),
                         checkpoint_format=os.environ.get("CHECKPOINT_FORMAT", "auto"),
                         async_checkpoint=bool(os.environ.get("ASYNC")),
                         callbacks=[Callback(on="train_batch_end", callback=fault),
                                    Callback(on="train_start", callback=started)])
    trained, _ = Trainer(model, optimizer, config, loss_fn="mse").fit(loader)
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
             for k, v in trained.state_dict().items()}
    torch.save(local, OUT / f"final-rank{RANK}.pt")


if __name__ == "__main__":
    main()

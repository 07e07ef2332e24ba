"""Checkpoint -> resume inside the image (scripts/ci-image.sh): train to --epochs with a checkpoint every epoch,
resuming from whatever is already in --folder, and print one JSON line the script checks.

    python resume_job.py --folder runs/resume --epochs 2   # fresh: epochs 1-2
    python resume_job.py --folder runs/resume --epochs 4   # resumed at epoch 2: epochs 3-4
    ... --records DIR   # each process also writes DIR/<tag>-rank<R>.json: its node, its Python, inside the image?
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--records", help="a folder for one record per process (scripts/ci-image.sh)")
    parser.add_argument("--tag", default="run")
    args = parser.parse_args()
    if args.records:
        record(Path(args.records), args.tag)
    x = torch.linspace(0, 1, 256).reshape(-1, 1)
    loader = DataLoader(TensorDataset(x, torch.sin(2 * torch.pi * x)), batch_size=32, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    config = TrainConfig(nprocs=args.nprocs, compute_setup="cpu", backend="gloo", max_iter=args.epochs, seed=0,
                         checkpoint_every=1, resume="auto", log_folder=args.folder, print_every=1)
    trainer = Trainer(model, optim.Adam(model.parameters(), lr=1e-2), config, loss_fn="mse")
    trainer.fit(loader)
    print(json.dumps({"end_epoch": trainer.current_epoch, "step": trainer.global_step}))


def record(folder: Path, tag: str) -> None:
    """Where this process runs: the node Slurm placed it on, the interpreter, and whether the image's marker is
    there -- a rank on the host's Python would show the host's venv and no marker."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{tag}-rank{rank}.json").write_text(json.dumps({
        "rank": int(rank), "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "executable": sys.executable, "prefix": sys.prefix,
        "in_image": Path("/opt/trainstack/versions.json").is_file()}))


if __name__ == "__main__":
    main()

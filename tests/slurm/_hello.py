"""A small trainstack program for the workflow tests: joins the group, all-reduces once, and reports what it got
(rank, world, node, argv, whether it ran inside the stand-in container) as rank<r>.json in $PROBE_OUT."""

import json
import os
import socket
import sys
from pathlib import Path

import torch

from trainstack import Accelerator


def hello(argv: list[str]) -> None:
    dist = torch.distributed
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    total = torch.tensor([float(rank)])
    if dist.is_initialized():
        dist.all_reduce(total)
    print(f"hello from rank {rank} of {world}", flush=True)
    record = {"rank": rank, "world": world, "sum": total.item(), "argv": argv, "cwd": os.getcwd(),
              "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
              "container": os.environ.get("INSIDE_STANDIN_CONTAINER")}
    (Path(os.environ["PROBE_OUT"]) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    nprocs = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
    Accelerator(nprocs=nprocs, compute_setup="cpu").distribute(hello)(sys.argv[1:])

"""Runs under srun in the Slurm tests: every rank writes what it sees into a JSON file."""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from trainstack import Accelerator


def probe(out_dir: str, accelerator: Accelerator) -> int:
    total = torch.tensor([float(accelerator.rank)])
    dist.all_reduce(total)
    record = {"rank": accelerator.rank, "world": accelerator.world_size, "local_rank": accelerator.local_rank,
              "node_rank": accelerator.node_rank, "num_nodes": accelerator.num_nodes,
              "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "sum": total.item(),
              "pid": os.getpid()}
    with open(os.path.join(out_dir, f"rank{accelerator.rank}.json"), "w") as fh:
        json.dump(record, fh)
    return accelerator.rank


if __name__ == "__main__":
    out, nprocs = sys.argv[1], int(sys.argv[2])
    acc = Accelerator(nprocs=nprocs, compute_setup="cpu")
    acc.distribute(probe)(out, acc)

"""Runs under srun in the Slurm tests: strategy='hsdp' with its default layout (one replica per node); every rank
records its node and the ranks of its mesh groups after one training step."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from trainstack import Accelerator

if __name__ == "__main__":
    acc = Accelerator(compute_setup="cpu", strategy="hsdp", fsdp_blocks=("Linear",))
    torch.manual_seed(0)
    model = acc.prepare(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    mesh = acc.device_mesh
    record = {"rank": acc.rank, "node": os.environ.get("SLURMD_NODENAME"), "dims": list(mesh.mesh_dim_names),
              **{name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names}}
    with open(os.path.join(sys.argv[1], f"rank{acc.rank}.json"), "w") as fh:
        json.dump(record, fh)

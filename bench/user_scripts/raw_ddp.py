"""A short run as people write it without a framework: mp.spawn + DDP (in-process for one), a final torch.save
(the reference)."""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _clock import first_step_ended, write  # noqa: E402

WORKLOAD = os.environ.get("WORKLOAD", "mlp")  # tiny: too small to hide fixed costs; lm: a small transformer LM
STEPS, BATCH = int(os.environ.get("STEPS", "30")), 32 if WORKLOAD == "lm" else 256
WIDTH = 16 if WORKLOAD == "tiny" else 2048
VOCAB, CONTEXT = 96, 64


class MLP(nn.Module):
    """The model of the workload (a character-level transformer LM for ``lm``, as the UX review's port)."""

    def __init__(self) -> None:
        super().__init__()
        if WORKLOAD == "lm":
            self.embed = nn.Embedding(VOCAB, 64)
            self.net = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 256, batch_first=True),
                                                           2), nn.Linear(64, VOCAB))
        else:
            self.net = nn.Sequential(nn.Linear(512, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                                     nn.Linear(WIDTH, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if WORKLOAD == "lm":
            return self.net(self.embed(x)).mean(1)  # one prediction per sequence: the loss stays the same code
        return self.net(x)


def data(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = STEPS * BATCH * world
    inputs = torch.randint(0, VOCAB, (n, CONTEXT), generator=g) if WORKLOAD == "lm" else \
        torch.randn(n, 512, generator=g)
    return TensorDataset(inputs, torch.randint(0, 10, (n,), generator=g))


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.register_step_post_hook(first_step_ended)
    ds = data(world)
    for x, y in DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, world, rank)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, os.path.join(out, "final.pt"))
        write(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, out = int(sys.argv[1]), sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if world == 1:  # one process: no workers to start
        worker(0, 1, port, out)
    else:
        mp.spawn(worker, args=(world, port, out), nprocs=world)

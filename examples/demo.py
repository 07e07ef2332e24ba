"""The `make run` demo: fit y = sin(2*pi*x) with a small MLP on N processes and print the loss per epoch.

    python examples/demo.py --nprocs 2                 # 2 CPU processes, gloo (the default)
    torchrun --standalone --nproc_per_node 2 examples/demo.py
    srun python examples/demo.py --nprocs 4            # one Slurm task per node spawns its share
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Accelerator


def train(model, loader, epochs: int, accelerator: Accelerator) -> dict:
    accelerator.seed_everything(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(f"training on {accelerator.world_size} process(es), backend={accelerator.backend}, "
                      f"device={accelerator.device}")
    for epoch in range(1, epochs + 1):
        total, batches = torch.zeros(()), 0
        for xs, ys in loader:
            xs, ys = accelerator.prepare_batch((xs, ys))
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            optimizer.step()
            total += loss.detach().cpu()
            batches += 1
        mean = accelerator.all_reduce_dict({"loss": total / max(batches, 1)})["loss"]
        accelerator.print(f"epoch {epoch:3d}/{epochs}  loss {mean.item():.5f}")
    return {"rank": accelerator.rank, "final_loss": float(mean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--compute_setup", default="cpu", choices=["cpu", "gpu", "auto"])
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl", None])
    args = parser.parse_args()

    x = torch.linspace(0, 1, 512).reshape(-1, 1)
    loader = DataLoader(TensorDataset(x, torch.sin(2 * torch.pi * x)), batch_size=32, shuffle=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    accelerator = Accelerator(nprocs=args.nprocs, compute_setup=args.compute_setup, backend=args.backend)
    start = time.perf_counter()
    result = accelerator.distribute(train)(model, loader, args.epochs, accelerator)
    if result is not None and result["rank"] == 0:  # under torchrun/srun every rank is its own caller
        print(f"done in {time.perf_counter() - start:.1f}s: final loss {result['final_loss']:.5f} (from rank "
              f"{result['rank']})")


if __name__ == "__main__":
    main()

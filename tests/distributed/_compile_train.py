"""A compiled Trainer run for tests/distributed/test_compile.py, in its own process (so inductor's in-memory caches
start cold): ``python _compile_train.py FOLDER MODE [EPOCHS]`` prints one JSON line with the final loss, the
parameters' checksum and the first step's compile time.

MODE: ``eager``, ``inductor``, ``slow-rank`` (rank 1's compile backend takes 8 s while hang_timeout is 2 s and the
collective timeout 4 s), ``fsdp`` (FSDP2 + compile), ``user`` (the user passes torch.compile(model)), ``broken``
(a forward dynamo cannot trace with fullgraph=True). NPROCS: the processes (2 unless set)."""

import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer


def slow_on_rank1(gm, example_inputs):
    """A compile backend: plain eager, but rank 1 takes 8 s to 'compile'."""
    if os.environ.get("RANK") == "1":
        time.sleep(8)
    return gm.forward


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: no single graph
            return self.lin(x)
        return -self.lin(x)


def main(folder: str, mode: str, epochs: int) -> None:
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)),
                      batch_size=32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)) if mode != "broken" else Branchy()
    compile_ = {"eager": False, "inductor": True, "slow-rank": {"backend": slow_on_rank1}, "fsdp": True,
                "user": False, "broken": {"fullgraph": True}}[mode]
    if mode == "user":
        model = torch.compile(model)
    cfg = TrainConfig(nprocs=int(os.environ.get("NPROCS", "2")), compute_setup="cpu", max_iter=epochs,
                      log_folder=folder, compile=compile_, seed=1,
                      resume="auto", strategy="fsdp" if mode == "fsdp" else "ddp",
                      hang_timeout=2 if mode == "slow-rank" else None)
    trained, _ = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, loss_fn="mse").fit(data)
    with torch.no_grad():
        x, y = data.dataset.tensors
        loss = nn.functional.mse_loss(trained(x), y).item()
    torch.save(trained.state_dict(), os.path.join(folder, "final.pt"))
    print(json.dumps({"loss": loss, "keys": sorted(trained.state_dict())[:2],
                      "checksum": float(sum(p.double().sum() for p in trained.state_dict().values()))}), flush=True)


if __name__ == "__main__":
    if os.environ.get("UMASK"):  # a user's umask in a shared project folder
        os.umask(int(os.environ["UMASK"], 8))
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3)

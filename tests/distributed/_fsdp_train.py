"""Trained by test_fsdp.py (module-level, so spawned workers can import it): a small model, data whose samples carry
their id, a loss that records which samples each rank saw, and callbacks that stop mid-epoch or dump the state."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer

N_SAMPLES = 60  # 2 ranks x batch 2 stop after 3 steps: 12 consumed, 48 left = a multiple of 1, 2 and 3 ranks x 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(width, width), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


def model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), Block(width), Block(width), nn.Linear(width, 1))


def data(n: int = N_SAMPLES) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(n, dtype=torch.float32).reshape(-1, 1)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g), ids),
                      batch_size=2, shuffle=True)


def recording_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y, ids = batch
    out = os.environ.get("FSDP_IDS")
    if out and model.training:
        with open(f"{out}-rank{os.environ.get('RANK', '0')}.jsonl", "a") as fh:
            fh.write(json.dumps([int(i) for i in ids.reshape(-1).tolist()]) + "\n")
    return nn.functional.mse_loss(model(x), y)


def touch_stop_at_step_3(trainer, config, writer) -> None:
    if trainer.global_step == int(os.environ.get("FSDP_STOP_STEP", "3")) and trainer.accelerator.rank == 0:
        Path(os.environ["FSDP_STOP"]).touch()


def dump_mesh(trainer, config, writer) -> None:
    """Every rank writes the ranks of its mesh groups (HSDP: replicate and shard), for the layout test."""
    mesh = trainer.accelerator.device_mesh
    import torch.distributed as dist

    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names}
    Path(f"{os.environ['FSDP_MESH']}-rank{dist.get_rank()}.json").write_text(json.dumps(groups))


def dump_state_at_start(trainer, config, writer) -> None:
    """Every rank takes part (the gather is a collective); rank 0 writes the model and optimizer, whole."""
    from trainstack._runtime.fsdp import full_state, is_sharded

    if is_sharded(trainer.model):
        model_sd, optim_sd = full_state(trainer.model, trainer.optimizer)
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    if trainer.accelerator.rank == 0:
        torch.save({"model": {k: v.detach().cpu() for k, v in model_sd.items()}, "optimizer": optim_sd},
                   os.environ["FSDP_DUMP"])


def config(folder: Path, nprocs: int, strategy: str = "fsdp", **kw) -> TrainConfig:
    base = {"nprocs": nprocs, "compute_setup": "cpu", "max_iter": 2, "log_folder": folder, "verbose": False,
            "strategy": strategy, "seed": 3, "checkpoint_every": 1, "stop_check_every": 1}
    if strategy in ("fsdp", "hsdp"):
        base |= {"fsdp_blocks": ("Block",)}
    return TrainConfig(**(base | kw))


def fit(folder: Path, nprocs: int, strategy: str = "fsdp", init: int = 0, **kw) -> nn.Module:
    m = model(init)
    Trainer(m, torch.optim.Adam(m.parameters(), lr=0.01), config(folder, nprocs, strategy, **kw),
            loss_fn=recording_loss).fit(data())
    return m


def _pause_second_commit() -> None:
    """For the SIGKILL test: rank 0 stops forever just before committing its second checkpoint."""
    from trainstack._checkpoint import sharded as _dcp

    real, calls = _dcp._commit, []

    def paused(temp, final, is_main):
        if is_main:
            calls.append(final)
            if len(calls) == 2:
                Path(os.environ["FSDP_MARKER"]).touch()
                time.sleep(120)
        return real(temp, final, is_main)

    _dcp._commit = paused


if os.environ.get("FSDP_MARKER"):  # applied in every spawned worker, which imports this module as __main__
    _pause_second_commit()

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fit(Path(sys.argv[1]), int(sys.argv[2]), max_iter=4)

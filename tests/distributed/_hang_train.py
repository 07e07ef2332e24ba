"""Trained by test_watchdog.py: a rank that stops before the collective of step 5, one that is merely slow, and a
checkpoint that takes long (module-level so spawned workers can import them)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def sleep_forever() -> None:
    while True:
        time.sleep(1)


class Stuck:
    """The loss; on rank 1 it never returns at step 5 (so the others wait in the gradient all-reduce)."""

    def __init__(self, stuck_rank: int = 1, at_step: int = 5, slow: float = 0.0) -> None:
        self.stuck_rank, self.at_step, self.slow, self.calls = stuck_rank, at_step, slow, 0

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        self.calls += 1
        rank = int(os.environ.get("RANK", "0"))
        if rank == self.stuck_rank:
            if self.at_step and self.calls == self.at_step:
                sleep_forever()
            time.sleep(self.slow)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def slow_save(trainer, config, writer) -> None:
    """A checkpoint write that takes long: everyone waits for rank 0 at the next collective."""
    from trainstack import checkpoint

    real = checkpoint.atomic_save

    def slowly(obj, path):
        time.sleep(float(os.environ.get("SLOW_SAVE_S", "3")))
        return real(obj, path)

    checkpoint.atomic_save = slowly


def data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

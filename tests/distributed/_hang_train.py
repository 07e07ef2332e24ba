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


class SlowFirst:
    """The loss; its first call sleeps ``first`` seconds on the ranks in ``ranks`` (a compile warm-up)."""

    def __init__(self, first: float, ranks: tuple[int, ...] = (0, 1)) -> None:
        self.first, self.ranks, self.calls = first, ranks, 0

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1 and int(os.environ.get("RANK", "0")) in self.ranks:
            time.sleep(self.first)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def slow_callback(trainer, config, writer) -> None:
    """A rank-0 epoch-end callback that takes long (a plot, an upload)."""
    if trainer.accelerator.rank == 0:
        time.sleep(float(os.environ.get("SLOW_CALLBACK_S", "3")))


def slow_async_commit(trainer, config, writer) -> None:
    """Asynchronous sharded saves whose background write takes long (a slow file system)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.write_data

    def slowly(self, plan, planner):
        time.sleep(float(os.environ.get("SLOW_SAVE_S", "3")))
        return real(self, plan, planner)

    FileSystemWriter.write_data = slowly


def hold_the_gil(trainer, config, writer) -> None:
    """Rank 0 computes in C without releasing the GIL: its watchdog thread cannot run."""
    if trainer.accelerator.rank == 0 and trainer.global_step >= 3:
        sum(range(10**12))


def custom_loop(seconds: float) -> int:
    """A hand-written loop on data made on the fly: never a prepared loader, never accelerator.heartbeat()."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        time.sleep(0.01)
    return steps

"""Evaluation: validation and test metrics reduced over every rank, sample-weighted, without the padding duplicates a
DistributedSampler adds -- so the numbers equal a single-process evaluation of the same data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .._runtime import collectives
from .._runtime.watchdog import heartbeat
from ..data import DictDataLoader, epoch_batches, prepare_eval_dataloader
from ..errors import ConfigError
from .steps import call_loss

__all__ = ["Evaluator", "prepare_eval", "batch_size"]

#: ``fire(event, batch_index, loss, metrics)``: the Trainer's batch events (``val_batch_start`` ...).
Fire = Callable[[str, int, Any, Any], None]


class Evaluator:
    """Runs one evaluation pass of ``loss_fn`` on a sharded loader and reduces it over all ranks."""

    def __init__(self, accelerator: Any, loss_fn: Callable[..., Any], fire: Fire) -> None:
        self.accelerator, self.loss_fn, self.fire = accelerator, loss_fn, fire

    def __call__(self, phase: str, model: nn.Module, loader: Any) -> dict[str, float]:
        """Sample-weighted mean of loss and metrics over all ranks (the unwrapped model: no DDP sync)."""
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = 0.0
        start, end = f"{phase}_batch_start", f"{phase}_batch_end"
        i, batch, hb = 0, None, heartbeat()
        hb.phase = "eval"
        with torch.no_grad():
            for i, batch in enumerate(epoch_batches(loader), 1):  # batch events count this pass's batches
                hb.tick += 1
                batch = self.accelerator.prepare_batch(batch)
                self.fire(start, i, None, None)
                loss, metrics = call_loss(self.loss_fn, model, batch)
                size = float(batch_size(batch))
                count += size
                for k, v in {"loss": loss, **metrics}.items():
                    totals[k] = totals.get(k, 0.0) + v.detach().float() * size
                self.fire(end, i, loss, metrics)
            self.even_out_forwards(model, loader, i, batch)
        model.train(was_training)
        reduced = collectives.all_reduce_dict({**totals, "__count": count}, "sum")
        denom = max(float(reduced.pop("__count")), 1.0)
        return {f"{phase}_{k}": float(v) / denom for k, v in reduced.items()}

    def test(self, model: nn.Module, loader: Any) -> dict[str, float]:
        """``Trainer.test``: the model on this rank's device (DDP-free: evaluation needs no gradient sync), the
        loader sharded without duplicates."""
        acc = self.accelerator
        model = acc.prepare_model(model) if acc.world_size == 1 else model.to(acc.device)
        return self("test", model, prepare_eval(loader, acc.rank, acc.world_size))

    def even_out_forwards(self, model: nn.Module, loader: Any, done: int, batch: Any) -> None:
        """A sharded model's forward is a collective: ranks with fewer evaluation batches (the shards differ by one
        sample) run discarded forwards until every rank has run as many."""
        from .._runtime.fsdp import is_sharded

        if not is_sharded(model) or self.accelerator.world_size == 1:
            return
        most = int(collectives.all_reduce_dict({"n": float(done)}, "max")["n"])
        if most > done and batch is None:  # this rank had no batch at all: borrow one sample of the dataset
            batch = self.accelerator.prepare_batch(next(iter(DataLoader(_dataset_of(loader), batch_size=1))))
        for _ in range(most - done):
            call_loss(self.loss_fn, model, batch)


def prepare_eval(loader: Any, rank: int, world: int) -> Any:
    """This rank's share of an evaluation loader, every sample exactly once over all ranks."""
    if isinstance(loader, DictDataLoader):
        return loader.prepared(lambda dl: prepare_eval_dataloader(dl, rank, world))
    return prepare_eval_dataloader(loader, rank, world) if loader is not None else None


def _dataset_of(loader: Any) -> Any:
    if isinstance(loader, DictDataLoader):
        raise ConfigError("evaluating a sharded (fsdp) model on a dict of loaders needs every rank to hold at least "
                          "one batch: use at least as many samples per loader as processes.")
    return loader.dataset


def batch_size(batch: Any) -> int:
    """How many samples a batch holds (the first dimension of its first tensor; 1 when it has none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size(item)
            if size:
                return size
    return 1

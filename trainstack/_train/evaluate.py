"""Evaluation: validation and test metrics reduced over every rank, sample-weighted, without the padding duplicates a
DistributedSampler adds -- so the numbers equal a single-process evaluation of the same data."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from .._runtime import collectives
from .._runtime.watchdog import heartbeat
from ..data import DictDataLoader, epoch_batches, prepare_eval_dataloader
from ..errors import ConfigError
from .steps import call_loss

if TYPE_CHECKING:
    from ..accelerator import Accelerator

__all__ = ["Evaluator", "prepare_eval", "batch_size", "default_predict", "assemble"]

#: ``fire(event, batch_index, loss, metrics)``: the Trainer's batch events (``val_batch_start`` ...).
Fire = Callable[[str, int, Any, Any], None]


class Evaluator:
    """Runs one evaluation pass of ``loss_fn`` on a sharded loader and reduces it over all ranks."""

    def __init__(self, accelerator: Accelerator, loss_fn: Callable[..., Any], fire: Fire,
                 amp_dtype: torch.dtype | None = None) -> None:
        self.accelerator, self.loss_fn, self.fire = accelerator, loss_fn, fire
        self.amp_dtype = amp_dtype  # evaluation runs in training's numeric regime (Lightning and Accelerate agree)

    def autocast(self) -> Any:
        device = self.accelerator.device.type
        return torch.autocast(device, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def __call__(self, phase: str, model: nn.Module, loader: Any) -> dict[str, float]:
        """Sample-weighted mean of loss and metrics over all ranks (the unwrapped model: no DDP sync)."""
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = 0.0
        start, end = f"{phase}_batch_start", f"{phase}_batch_end"
        i, batch, hb = 0, None, heartbeat()
        hb.phase = "eval"
        with torch.random.fork_rng(devices=[]):  # creating the iterator draws a seed: never from training's RNG,
            batches = iter(epoch_batches(loader))  # whose sequence must not depend on a persistent loader's age
        with torch.no_grad(), self.autocast():
            for i, batch in enumerate(batches, 1):  # batch events count this pass's batches
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
        layout = acc.layout
        return self("test", model, prepare_eval(loader, layout.data_rank(acc.rank), layout.data_world))

    def predict(self, model: nn.Module, loader: Any, predict_fn: Callable[[nn.Module, Any], Any]) -> Any:
        """``Trainer.predict`` on this rank: ``predict_fn(model, batch)`` over this rank's share of the dataset (every
        sample once over all ranks), concatenated on the CPU; rank 0 gets everything in dataset order
        (``assemble``), the other ranks None."""
        acc = self.accelerator
        if isinstance(loader, DictDataLoader):
            raise ConfigError("predict() takes one DataLoader, not a dict of them: call it once per loader.")
        model = acc.prepare_model(model) if acc.world_size == 1 else model.to(acc.device)
        layout = acc.layout
        shard = prepare_eval_dataloader(loader, layout.data_rank(acc.rank), layout.data_world, ordered=True)
        was_training, outputs, batch, hb = model.training, [], None, heartbeat()
        model.eval()
        hb.phase = "predict"
        with torch.no_grad(), self.autocast():
            for batch in epoch_batches(shard):
                hb.tick += 1
                outputs.append(_to_cpu(predict_fn(model, acc.prepare_batch(batch)), self.amp_dtype))
            self.even_out_forwards(model, shard, len(outputs), batch, lambda b: predict_fn(model, b))
        model.train(was_training)
        mine = _concat(outputs)
        if acc.world_size == 1:
            return mine
        parts = collectives.gather_objects(mine)
        return assemble(parts) if parts is not None else None

    def even_out_forwards(self, model: nn.Module, loader: Any, done: int, batch: Any,
                          forward: Callable[[Any], Any] | None = None) -> None:
        """A sharded model's forward is a collective: ranks with fewer evaluation batches (the shards differ by one
        sample) run discarded forwards until every rank has run as many."""
        from .._runtime.fsdp import is_sharded

        if not is_sharded(model) or self.accelerator.world_size == 1:
            return
        most = int(collectives.all_reduce_dict({"n": float(done)}, "max")["n"])
        if most > done and batch is None:  # this rank had no batch at all: borrow one sample of the dataset
            batch = self.accelerator.prepare_batch(next(iter(DataLoader(_dataset_of(loader), batch_size=1))))
        for _ in range(most - done):
            forward(batch) if forward is not None else call_loss(self.loss_fn, model, batch)


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


def default_predict(model: nn.Module, batch: Any) -> Any:
    """``model(inputs)``: the batch itself, or its first item for ``(inputs, targets)`` batches."""
    if isinstance(batch, (list, tuple)) and batch:
        return model(batch[0])
    if isinstance(batch, dict):
        raise ConfigError(f"predict(): the batches are dicts ({sorted(batch)[:4]}), so which one is the input is "
                          f"yours to say. HINT: predict(loader, predict_fn=lambda model, batch: model(batch['x'])).")
    return model(batch)


def _to_cpu(out: Any, amp_dtype: torch.dtype | None = None) -> Any:
    """Outputs on the CPU; those autocast made half precision back in float32 (as Accelerate returns them)."""
    from torch.utils._pytree import tree_map

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.detach().cpu()
        return leaf.float() if amp_dtype is not None and leaf.dtype == amp_dtype else leaf

    return tree_map(move, out)


def _concat(outputs: list[Any]) -> Any:
    """Per-batch outputs (a tensor, or a tuple/list/dict of them, one row per sample) joined along dim 0."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if not outputs:
        return None
    flat = [tree_flatten(out) for out in outputs]
    leaves0, spec = flat[0]
    for leaves, other in flat:
        if other != spec or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
            raise ConfigError("predict(): predict_fn must return a tensor, or a tuple/list/dict of tensors, with one "
                              "row per sample of the batch (the same structure for every batch).")
    return tree_unflatten([torch.cat([leaves[i] for leaves, _ in flat]) for i in range(len(leaves0))], spec)


def assemble(parts: list[Any]) -> Any:
    """Every rank's outputs back in dataset order: rank ``r`` predicted samples ``r, r + W, r + 2W, ...``."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    present = [p for p in parts if p is not None]
    if not present:
        return None
    spec = tree_flatten(present[0])[1]
    world = len(parts)
    per_rank = [tree_flatten(p)[0] if p is not None else None for p in parts]
    out = []
    for i, leaf in enumerate(tree_flatten(present[0])[0]):
        rows = sum(int(r[i].shape[0]) for r in per_rank if r is not None)
        joined = leaf.new_empty((rows, *leaf.shape[1:]))
        for rank, leaves in enumerate(per_rank):
            if leaves is not None:
                joined[rank::world] = leaves[i]
        out.append(joined)
    return tree_unflatten(out, spec)

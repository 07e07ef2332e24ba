"""``TrainConfig(fast_dev_run=N)``: Lightning's smoke test of the whole loop before the real run -- N optimizer
steps, one validation on N batches, the final checkpoint written and read back by nothing -- in a throw-away run
folder, so nothing of it is kept, tracked or resumed later."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["fast_dev_run", "first_batches", "refuse_after"]


def first_batches(loader: Any, n: int) -> Any:
    """The loader's first ``n`` batches as a loader of the same batching (a map-style dataset; anything else is
    returned whole: it cannot be cut without iterating it)."""
    dataset = getattr(loader, "dataset", None)
    size = getattr(loader, "batch_size", None)
    if not isinstance(loader, DataLoader) or not isinstance(dataset, Dataset) or isinstance(dataset, IterableDataset) \
            or not size or getattr(loader, "batch_sampler", None) is None:
        return loader
    indices = list(itertools.islice(iter(loader.sampler), n * size))
    return DataLoader(Subset(dataset, indices), batch_size=size, collate_fn=loader.collate_fn,
                      drop_last=loader.drop_last)


def fast_dev_run(trainer: Trainer, train_loader: Any, val_loader: Any) -> Any:
    """Run ``trainer.fit`` as a smoke test and leave no trace: a temporary run folder, ``jsonl`` only, no periodic
    checkpoints; the Trainer is spent afterwards (its model took N steps: ``refuse_after`` says so), so the real
    run gets a new one."""
    cfg = trainer.config
    n = cfg.fast_dev_run
    val = val_loader if val_loader is not None else trainer.val_dataloader
    limited = first_batches(val, n) if val is not None else None
    folder = Path(tempfile.mkdtemp(prefix="trainstack-fast-dev-run-"))
    trainer.config = dataclasses.replace(
        cfg, fast_dev_run=0, max_iter=n, max_steps=n, val_every=0, val_every_n_steps=n if val is not None else 0,
        checkpoint_every=0, checkpoint_every_n_steps=0, memory_checkpoint_every_n_steps=0, checkpoint_best_only=False,
        resume=None,
        log_folder=folder, root_folder=folder, create_subfolder_per_run=False, tracking_tool="jsonl",
        write_every=0, plot_every=0, log_every_n_steps=1, print_every=0)
    try:
        result = trainer.fit(train_loader, limited)
    finally:
        trainer.config, trainer.val_dataloader = cfg, val
        shutil.rmtree(folder, ignore_errors=True)
    if trainer.accelerator.is_main_process and cfg.verbose:
        checked = f", a validation on {n} batch(es)" if val is not None else ""
        print(f"fast_dev_run={n}: {n} optimizer step(s){checked} and the final checkpoint ran through the whole "
              f"loop; nothing was kept. Set fast_dev_run=0 (or leave --fast_dev_run out) for the real run.",
              flush=True)
    return result


def refuse_after(fast_dev_ran: bool, what: str = "fit") -> None:
    """A Trainer whose fast_dev_run already trained its model must not go on as if it were the real run, nor look
    for checkpoints it never kept."""
    if not fast_dev_ran:
        return
    if what == "load":
        raise ConfigError("this Trainer ran fast_dev_run, which keeps no checkpoints (its run folder was a "
                          "throw-away one): there is nothing to load. HINT: run the real training (fast_dev_run=0) "
                          "first, or load a checkpoint file by its path in a new Trainer.")
    raise ConfigError("this Trainer ran fast_dev_run: its model already took those steps. HINT: build a new "
                      "model, optimizer and Trainer (with fast_dev_run=0) for the real run.")

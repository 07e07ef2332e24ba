"""What a run reports, on rank 0 only: the banner, metrics lines, metrics.jsonl (plus TensorBoard or MLflow),
plots, the progress bar, hyperparameters, the model, and the loss curve at the end.

The loop calls it by name at its three moments (``epoch_end``, ``batch_end`` every ``bar_every`` steps, ``close``);
every other rank gets one that does nothing. ``.item()`` (a host sync) happens only here, when a line is printed or
a row written.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from ..data import DictDataLoader, is_infinite
from .progress import ProgressBar, banner, progress_enabled
from .writers import NullWriter, Writers, format_metrics, make_writers, save_loss_curve

__all__ = ["Tracker", "banner_info"]

log = logging.getLogger(__name__)


class Tracker:
    """Rank 0's reports for one run folder, at the cadence ``config`` asks for."""

    def __init__(self, config: Any, folder: Path | None, is_main: bool, start_epoch: int = 0,
                 last_epoch: int = 0, batches_per_epoch: int | None = None, keep_through: int | None = None,
                 clock: Any = None) -> None:
        self.config, self.is_main = config, is_main
        self.writer: Writers = make_writers(config.tracking_tool, folder, start_epoch, keep_through, clock) \
            if is_main and folder is not None else NullWriter()
        self.folder = folder
        self.bar = ProgressBar(last_epoch, start_epoch, batches_per_epoch) \
            if is_main and progress_enabled(config.verbose) else None
        self.bar_every = self.bar.every if self.bar else 0

    def print(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def start(self, info: dict[str, Any]) -> None:
        if self.is_main and self.config.verbose:
            print(banner(info), flush=True)
        if self.bar:
            self.bar.start()

    def batch_end(self) -> None:
        if self.bar:
            self.bar.advance()

    def epoch_end(self, epoch: int, metrics: dict[str, Any], model: Any) -> None:
        """A metrics line every ``print_every`` epochs, a row every ``write_every`` (default 1), plots."""
        if not self.is_main:
            return
        cfg = self.config
        if cfg.verbose and cfg.print_every and epoch % cfg.print_every == 0:
            print(format_metrics(epoch, metrics), flush=True)
        if metrics and epoch % (cfg.write_every or 1) == 0:
            self.writer.write(epoch, metrics)
        if cfg.plot_every and epoch % cfg.plot_every == 0:
            self.writer.plot(model, epoch, cfg.plotting_functions)
        if self.bar:
            self.bar.epoch_end(epoch, metrics.get("train_loss"))

    def train_end(self, epoch: int, model: Any) -> None:
        """The reports of a finished run: a last plot, the hyperparameters, the model (MLflow)."""
        if not self.is_main:
            return
        cfg = self.config
        if cfg.plot_every:
            self.writer.plot(model, epoch, cfg.plotting_functions)
        if cfg.hyperparams:
            self.writer.log_hyperparams(cfg.hyperparams)
        if cfg.log_model:
            self.writer.log_model(model)

    def close(self) -> None:
        """Stop the bar, draw the loss curve, close the writers. Failures here are logged, never raised: they must
        not hide the error that ended the run."""
        if self.bar:
            self.bar.stop()
            self.bar = None
        writer, self.writer = self.writer, NullWriter()
        if not self.is_main or self.folder is None:
            return
        try:
            if writer.history:
                save_loss_curve(writer.history, self.folder / "loss_curve.png")
        except Exception as exc:  # e.g. a full disk: the checkpoint error the user needs came first
            log.warning("could not draw %s: %s", self.folder / "loss_curve.png", exc)
        try:
            writer.close()
        except Exception as exc:
            log.warning("could not close the metric writers: %s", exc)

    @staticmethod
    def line(iteration: int, metrics: dict[str, Any]) -> str:
        return format_metrics(iteration, metrics)


def banner_info(trainer: Any, per_epoch: int | None, last_epoch: int, hang_timeout: float) -> dict[str, Any]:
    """What the start banner shows: the data, the processes, the batch sizes, the steps ahead, the folder."""
    acc, cfg, loader = trainer.accelerator, trainer.config, trainer.train_dataloader
    per_proc = getattr(loader, "batch_size", None) or 1
    steps = "unknown (the loader has no length)" if per_epoch is None else \
        math.ceil(per_epoch / cfg.gradient_accumulation_steps) * max(last_epoch - trainer.current_epoch, 0)
    info: dict[str, Any] = {
        "Num examples": _num_examples(loader), "Num epochs": last_epoch - trainer._run_start,
        "Batches per epoch": per_epoch if per_epoch is not None else "until the loader ends",
        "Processes": f"{acc.world_size} ({acc.backend} on {acc.device.type})",
        "Batch size per process": per_proc,
        "Total batch size (w. parallel & accumulation)": per_proc * acc.world_size * cfg.gradient_accumulation_steps,
        "Gradient accumulation steps": cfg.gradient_accumulation_steps,
        "Total optimization steps": steps, "Run folder": trainer.run_folder,
        "Hang watchdog": f"armed: {hang_timeout:g} s without progress (3x for the first step, checkpoints, "
                         f"callbacks)" if hang_timeout else "off"}
    if is_infinite(trainer._train_loader) and not trainer.max_batches:
        info["Batches per epoch"] = "1 (an endless loader; set max_batches for more)"
    if trainer.current_epoch:
        info["Continuing at epoch"] = trainer.current_epoch
    return info


def _num_examples(loader: Any) -> Any:
    if isinstance(loader, DictDataLoader):
        return {k: _num_examples(v) for k, v in loader.dataloaders.items()}
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return "unknown"

"""What users see on rank 0: a start banner and a rich progress bar with global progress."""

from __future__ import annotations

import os
import sys
from typing import Any

from .callbacks.base import Callback

__all__ = ["ProgressBar", "banner", "progress_enabled"]


def progress_enabled(verbose: bool) -> bool:
    """Bar on when verbose and stdout is a terminal; TRAINSTACK_PROGRESS=1/0 forces it on/off."""
    forced = os.environ.get("TRAINSTACK_PROGRESS")
    if forced is not None:
        return forced not in ("0", "false", "")
    return verbose and sys.stdout.isatty()


def banner(info: dict[str, Any]) -> str:
    width = max(len(k) for k in info)
    lines = ["***** Running training *****"] + [f"  {k:<{width}} = {v}" for k, v in info.items()]
    return "\n".join(lines)


class ProgressBar:
    """A rich bar over all batches of the run, advanced every ~5 % of an epoch (never a redraw per step)."""

    def __init__(self, total_epochs: int, start_epoch: int, batches_per_epoch: int | None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.batches = batches_per_epoch
        self.every = max((batches_per_epoch or 20) // 20, 1)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeRemainingColumn(), transient=False)
        total = total_epochs * batches_per_epoch if batches_per_epoch else total_epochs
        done = start_epoch * batches_per_epoch if batches_per_epoch else start_epoch
        self.task = self.progress.add_task("training", total=total, completed=done, loss="")
        self._pending = 0

    def callbacks(self) -> list[Callback]:
        """Adapters that feed the bar from the trainer's events (rank 0 only)."""
        bar = self

        class _Hook(Callback):
            main_process_only = True

            def __init__(self, on: str, fn: Any, every: int = 1) -> None:
                super().__init__(on=on, called_every=every)
                self.fn = fn

            def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
                self.fn(trainer)

        hooks = [_Hook("train_start", lambda t: bar.progress.start()),
                 _Hook("train_epoch_end", bar.epoch_end), _Hook("train_end", lambda t: bar.progress.stop())]
        if self.batches:
            hooks.append(_Hook("train_batch_end", bar.batch_end, self.every))
        return hooks

    def batch_end(self, trainer: Any) -> None:
        self.progress.advance(self.task, self.every)

    def epoch_end(self, trainer: Any) -> None:
        loss = trainer.opt_result.metrics.get("train_loss")
        text = f"loss {float(loss):.4g}" if loss is not None else ""
        if self.batches:
            self.progress.update(self.task, completed=trainer.current_epoch * self.batches, loss=text)
        else:
            self.progress.update(self.task, advance=1, loss=text)

"""What users see on rank 0 while training: a start banner and a rich progress bar over the whole run."""

from __future__ import annotations

import os
import sys
from typing import Any

from .. import _envvars as envvars

__all__ = ["ProgressBar", "banner", "progress_enabled"]


def progress_enabled(verbose: bool) -> bool:
    """Bar on when verbose and stdout is a terminal; TRAINSTACK_PROGRESS=1/0 forces it on/off."""
    forced = os.environ.get(envvars.PROGRESS)
    if forced is not None:
        return forced not in ("0", "false", "")
    return verbose and sys.stdout.isatty()


def banner(info: dict[str, Any]) -> str:
    width = max(len(k) for k in info)
    lines = ["***** Running training *****"] + [f"  {k:<{width}} = {v}" for k, v in info.items()]
    return "\n".join(lines)


class ProgressBar:
    """A bar over all batches of the run, advanced every ``every`` batches (~5 % of an epoch), never per step."""

    def __init__(self, total_epochs: int, start_epoch: int, batches_per_epoch: int | None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.batches = batches_per_epoch
        self.every = max((batches_per_epoch or 20) // 20, 1) if batches_per_epoch else 0
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TimeRemainingColumn(), transient=False)
        total = total_epochs * batches_per_epoch if batches_per_epoch else total_epochs
        done = start_epoch * batches_per_epoch if batches_per_epoch else start_epoch
        self.task = self.progress.add_task("training", total=total, completed=done, loss="")

    def start(self) -> None:
        self.progress.start()

    def advance(self) -> None:
        self.progress.advance(self.task, self.every)

    def epoch_end(self, epoch: int, loss: Any) -> None:
        text = f"loss {float(loss):.4g}" if loss is not None else ""
        if self.batches:
            self.progress.update(self.task, completed=epoch * self.batches, loss=text)
        else:
            self.progress.update(self.task, advance=1, loss=text)

    def stop(self) -> None:
        self.progress.stop()

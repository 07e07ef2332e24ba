"""Validation inside ``fit()`` (torchtitan's validator): where the schedule puts it, one pass over the validation
loader with its callbacks, what they log kept apart from training's values, its line and row -- and never twice at
one step. The Run's collaborator (``run.validator``), called by name from the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .evaluate import Evaluator

if TYPE_CHECKING:
    from .run import Run

__all__ = ["Validator"]


class Validator:
    """The validations of ``run``; ``last_step`` is the step of the latest one (a checkpoint records it)."""

    def __init__(self, run: Run, evaluate: Evaluator) -> None:
        self.run, self.evaluate = run, evaluate
        self.last_step = -1

    def at_epoch_end(self, due: set[str]) -> None:
        """The epoch's validation where the schedule puts one, unless one ran at this step already (mid-epoch)."""
        run = self.run
        if "val" in due and run.val_loader is not None and self.last_step != run.progress.step:
            self()

    def __call__(self, position: float | None = None) -> None:
        """One validation at an epoch's end, or inside one at ``position`` (its callbacks then see the epoch in
        progress, 1-based). What its callbacks log (``trainer.log`` in ``val_epoch_end``) belongs to it: every later
        callback sees it, and it is on the validation's line and row, at its step."""
        run = self.run
        trainer, epoch = run.trainer, run.progress.epoch
        callbacks_epoch = epoch + 1 if position is not None else epoch
        with trainer.log_values.apart():
            trainer.callbacks.fire("val_epoch_start", trainer, callbacks_epoch)
            values = self.evaluate("val", run.model, run.val_loader)
            trainer.metrics.update(values)
            self.last_step = run.progress.step
            trainer.callbacks.fire("val_epoch_end", trainer, callbacks_epoch)
            values.update(trainer.log_values.collect(run.accelerator.all_reduce_dict))
        trainer.metrics.update(values)
        run.tracker.validation(epoch if position is None else position, run.progress.step, values,
                               row=position is not None)

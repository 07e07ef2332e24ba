"""How a run stops before its epochs are done, on every rank alike: mid-epoch stops agreed by the ranks (a signal,
the stop file, Ctrl-C, a stop any rank asked for, the step limit), the graceful stop's committed checkpoint and
what it tells the batch script, and a diverged run's stop before saving. The Run's collaborator
(``run.stops``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._common import jobevents as jobevents
from .._runtime import watchdog
from .._runtime.preemption import INTERRUPT
from . import notes
from .metrics import nonfinite_loss
from .progress import Stop

if TYPE_CHECKING:
    from .run import Run

__all__ = ["RunStops"]


class RunStops:
    """The stops of ``run``."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def here(self, due: set[str], epoch_end: bool) -> bool:
        """Mid-epoch stops: a graceful stop (signal, stop file, Ctrl-C), a stop any rank asked for (early stopping
        after a validation), or the step limit. True when training stops at this step."""
        run = self.run
        trainer = run.trainer
        if "poll" in due or ("val" in due and not epoch_end):
            agreed, why = run.stopper.agree(run.accelerator.world_size, stop=trainer.stop_training)
            if why is not None:
                self.gracefully(why)
                return True
            if agreed["stop"] and not epoch_end:
                run.progress.ask(Stop.REQUESTED, "another rank asked to stop", unless_stopping=True)
                run.tracker.print(f"Stopping at step {run.progress.step}: {trainer.stop_reason}.")
        if "max_steps" in due and not epoch_end:
            run.progress.ask(Stop.MAX_STEPS, f"max_steps={run.config.max_steps} reached", unless_stopping=True)
        return trainer.stop_training and not epoch_end

    def at_epoch_end(self, due: set[str]) -> None:
        """An epoch's end: the ranks agree (one small collective) on stopping -- a stop asked for or by
        ``trainstop_criterion``, a non-finite loss on any rank, a graceful stop -- then the checkpoint the schedule
        puts here (none for a diverged run: the last finite one must survive rotation), then the stop."""
        run = self.run
        trainer, cfg, epoch, step = run.trainer, run.config, run.progress.epoch, run.progress.step
        wants_stop = trainer.stop_training or bool(cfg.trainstop_criterion and cfg.trainstop_criterion(trainer))
        agreed, preempt = run.stopper.agree(run.accelerator.world_size, stop=wants_stop,
                                            nonfinite=cfg.stop_on_nonfinite and nonfinite_loss(trainer.metrics))
        if agreed["nonfinite"]:
            self.diverged()
            return
        if "checkpoint" in due:
            trainer.save_checkpoint()
        run.save_memory(due)
        if preempt and epoch < run.last_epoch and step < run.last_step:
            self.gracefully(preempt)
        elif agreed["stop"]:
            run.progress.ask(Stop.REQUESTED, "trainstop_criterion returned True", unless_stopping=True)
            run.tracker.print(f"Stopping after epoch {epoch}: {trainer.stop_reason}.")

    def gracefully(self, why: str) -> None:
        """A signal, the stop file or Ctrl-C: checkpoint (committed), tell the batch script, say how to resume."""
        run = self.run
        trainer = run.trainer
        kind = Stop.INTERRUPTED if why == INTERRUPT else Stop.PREEMPTED
        run.progress.ask(kind, f"{kind.value} ({why})")
        path = trainer.save_checkpoint()
        with watchdog.phase("checkpoint"):
            path = run.checkpointer.wait() or path  # an asynchronous save must be complete before the job ends
        if run.accelerator.is_main_process and kind is Stop.PREEMPTED:  # tells the batch script: requeue me
            run.stopper.confirm_saved(path or run.checkpointer.latest())
        line = notes.graceful_stop(kind.value, why, run.progress.epoch, run.progress.step, path,
                                   run.checkpointer.last_save_seconds, run.path)
        run.tracker.print(line)
        if run.accelerator.is_main_process:
            jobevents.record("graceful_stop", stop=kind.value, why=why, step=run.progress.step,
                             line=line.split(". ")[0])

    def diverged(self) -> None:
        """A non-finite loss on any rank: stop before saving, so the last finite checkpoint survives rotation."""
        run = self.run
        trainer = run.trainer
        reason = notes.diverged_reason(trainer.metrics.get("train_loss"), run.progress.epoch,
                                       run.checkpointer.latest())
        run.progress.ask(Stop.DIVERGED, reason)
        run.tracker.print(f"trainstack: {reason}")

"""Where a run is and why it stops, in one value: the Run advances it, the hand-off carries it, checkpoints record it,
and the Trainer's ``current_epoch``/``global_step``/``stop_training``/``stop_reason`` read it (Lightning's
``trainer.current_epoch`` reads its fit loop's progress the same way)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Progress", "ProgressView", "Stop"]


class Stop(enum.Enum):
    """Why training stops before its epochs are done, and what that makes of the run."""

    REQUESTED = "requested"  # EarlyStopping, a trainstop criterion, request_stop, another rank: the run's own end
    MAX_STEPS = "max_steps"  # the step limit: finished; a longer limit continues it
    PREEMPTED = "preempted"  # a signal or the stop file: a checkpoint to continue from, requeue me
    INTERRUPTED = "interrupted"  # Ctrl-C: a checkpoint to continue from
    DIVERGED = "diverged"  # a non-finite loss: stopped before saving

    @property
    def finishes(self) -> bool:
        """The run is over (summary, export, ``finished`` event), not cut short."""
        return self in (Stop.REQUESTED, Stop.MAX_STEPS)

    @property
    def for_good(self) -> bool:
        """Recorded in checkpoints: a resume has nothing left to train."""
        return self is Stop.REQUESTED


@dataclass
class Progress:
    """The loop's position (finished epochs, optimizer steps, batches) and its stop, if one was asked."""

    epoch: int = 0
    step: int = 0
    batch: int = 0
    stop: Stop | None = None
    why: str = ""  # the stop's reason in words (``words``: as the log and the summary say it)

    @property
    def stopping(self) -> bool:
        return self.stop is not None

    @property
    def finished(self) -> bool:
        """Not cut short: no stop, or one that ends the run."""
        return self.stop is None or self.stop.finishes

    def ask(self, stop: Stop, why: str, *, unless_stopping: bool = False) -> None:
        """Stop for ``why``; with ``unless_stopping`` an earlier stop keeps its reason."""
        if unless_stopping and self.stop is not None:
            return
        self.stop, self.why = stop, why

    @property
    def words(self) -> str:
        """The stop as the log and the summary say it: its reason, prefixed by what it made of a diverged run."""
        return f"{Stop.DIVERGED.value}: {self.why}" if self.stop is Stop.DIVERGED else self.why

    def resume(self) -> None:
        """A new ``fit()``: whatever stopped the last one is over."""
        self.stop, self.why = None, ""

    def stopped_by(self) -> str | None:
        """What checkpoints record of a stop that ends the run for good (None for any other)."""
        return self.why if self.stop is not None and self.stop.for_good else None

    def restore(self, counters: dict[str, Any]) -> None:
        """The position a checkpoint's counters record (decoded here once): finished epochs, optimizer steps,
        batches (older checkpoints counted batches only: then as many as steps)."""
        self.epoch, self.step = int(counters["epoch"]), int(counters["global_step"])
        self.batch = int(counters.get("global_batch", self.step))

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stop": self.stop.value if self.stop else None}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Progress:
        stop = state.get("stop")
        return cls(int(state["epoch"]), int(state["step"]), int(state["batch"]), Stop(stop) if stop else None,
                   str(state.get("why", "")))


class ProgressView:
    """The Trainer's position and stop, as its users read them (Lightning's names), over its one ``Progress``."""

    progress: Progress

    @property
    def current_epoch(self) -> int:
        """Finished epochs."""
        return self.progress.epoch

    @current_epoch.setter
    def current_epoch(self, value: int) -> None:
        self.progress.epoch = value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.progress.step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.progress.step = value

    @property
    def global_batch(self) -> int:
        """Batches trained (more than steps with gradient accumulation)."""
        return self.progress.batch

    @global_batch.setter
    def global_batch(self, value: int) -> None:
        self.progress.batch = value

    @property
    def stop_training(self) -> bool:
        """A stop was asked (``request_stop``, early stopping, a signal, the step limit, a non-finite loss)."""
        return self.progress.stopping

    @property
    def stop_reason(self) -> str:
        """That stop in words ("" without one)."""
        return self.progress.words

"""Which step-periodic duties fall on which optimizer step: ``Schedule``.

The loop's hot path compares the step with one precomputed number (``schedule.next``); only at that step does it
ask ``Schedule.due`` which duties it is for -- a log line, the progress bar, validation, a checkpoint, the stop
agreement, the step limit, the ``optimizer_step`` callbacks. Duties that involve every rank have the same periods
on every rank; rank-local ones (the clock behind time-based log lines, the bar) may differ. Torch-free.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from .._common.choices import check_int
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["Schedule", "Clock", "NEVER", "check"]

NEVER = sys.maxsize
#: The cadence settings: how often each duty falls (0: never).
CADENCE = ("max_iter", "print_every", "write_every", "checkpoint_every", "plot_every", "val_every", "log_every_n_steps",
           "val_every_n_steps", "checkpoint_every_n_steps", "memory_checkpoint_every_n_steps")


def check(config: TrainConfig) -> None:
    """The run's cadence settings, checked by their reader (``TrainConfig`` calls it at construction): periods are
    integers >= 0, a step limit >= 1, a log interval in seconds >= 0, and each duty has what it needs (best-only
    checkpoints a validation, plots their functions, memory checkpoints a restart that reads them)."""
    for name in CADENCE:
        check_int(name, getattr(config, name), minimum=0)
    if config.max_steps is not None:
        check_int("max_steps", config.max_steps, minimum=1)
    seconds = config.log_every_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ConfigError(f"TrainConfig.log_every_seconds={seconds!r} must be a number of seconds >= 0 (0: only "
                          f"every log_every_n_steps).")
    if config.checkpoint_best_only and config.val_every == 0 and config.val_every_n_steps == 0:
        raise ConfigError("TrainConfig.checkpoint_best_only=True needs validation: set val_every > 0 (or "
                          "val_every_n_steps) and pass a validation DataLoader.")
    if config.plot_every and not config.plotting_functions:
        raise ConfigError(f"TrainConfig.plot_every={config.plot_every} but plotting_functions is empty: nothing to "
                          f"plot. HINT: pass plotting_functions=(fn,) or set plot_every=0.")
    if config.memory_checkpoint_every_n_steps and config.resume != "auto":
        raise ConfigError(f"TrainConfig.memory_checkpoint_every_n_steps={config.memory_checkpoint_every_n_steps} "
                          f"but resume={config.resume!r}: only a restart with resume='auto' reads memory "
                          f"checkpoints. HINT: set resume='auto', or memory_checkpoint_every_n_steps=0.")


class Schedule:
    """Duties by period (in optimizer steps), plus one absolute step (the step limit); and the duties of an epoch's
    end, by epoch and by step. ``Schedule.of_run`` is the one reader of the run's cadence settings."""

    def __init__(self, periods: dict[str, int], last_step: int = NEVER,
                 at_epoch_end: dict[str, tuple[int, int]] | None = None, periodic_checkpoints: bool = True) -> None:
        self.periods = {name: every for name, every in periods.items() if every}
        self.last_step = last_step
        self.at_epoch_end = {name: pair for name, pair in (at_epoch_end or {}).items() if any(pair)}
        self.periodic_checkpoints = periodic_checkpoints  # False: best only (a final checkpoint neither)
        self.next = NEVER

    @classmethod
    def of_run(cls, config: TrainConfig, reports: dict[str, int], validates: bool, optimizer_step: int = 0,
               unbounded_report: int = 0, last_step: int = NEVER) -> Schedule:
        """A run's schedule: ``reports`` (the log line, bar and clock periods), validation and checkpoints as
        ``config`` says (``val_every[_n_steps]``, ``checkpoint_every[_n_steps]``, ``checkpoint_best_only``,
        ``memory_checkpoint_every_n_steps``), the stop agreement, the ``optimizer_step`` callbacks, the progress
        report of a loader without a length."""
        periodic = not config.checkpoint_best_only
        steps = {**reports, "poll": config.stop_check_every,
                 "val": config.val_every_n_steps if validates else 0,
                 "checkpoint": config.checkpoint_every_n_steps if periodic else 0,
                 "memory": config.memory_checkpoint_every_n_steps,
                 "optimizer_step": optimizer_step, "report": unbounded_report}
        at_end = {"val": (config.val_every, config.val_every_n_steps) if validates else (0, 0),
                  "checkpoint": (config.checkpoint_every, config.checkpoint_every_n_steps) if periodic else (0, 0),
                  "memory": (0, config.memory_checkpoint_every_n_steps)}
        return cls(steps, last_step, at_end, periodic)

    @staticmethod
    def check_validation(config: TrainConfig, loader: object) -> None:
        """Validation asked for without a loader is an error before any process starts."""
        if (config.val_every or config.val_every_n_steps) and loader is None:
            from ..errors import ConfigError

            asked = f"val_every={config.val_every}" if config.val_every else \
                f"val_every_n_steps={config.val_every_n_steps}"
            raise ConfigError(f"TrainConfig.{asked} but no validation DataLoader was given. HINT: "
                              f"fit(train_loader, val_loader) or Trainer(..., val_dataloader=...).")

    @staticmethod
    def memory_every(config: TrainConfig) -> int:
        """The memory checkpoints' period in optimizer steps (0: none): the Run opens them before the schedule."""
        return int(config.memory_checkpoint_every_n_steps or 0)

    @staticmethod
    def best_only(config: TrainConfig) -> bool:
        """Whether the run keeps only its best checkpoint (``checkpoint_best_only``: a ``ModelCheckpoint`` on
        ``val_loss`` does it)."""
        return bool(config.checkpoint_best_only)

    @property
    def validates(self) -> bool:
        """Whether the run validates at all (a validation loader and a validation cadence)."""
        return "val" in self.at_epoch_end or "val" in self.periods

    def due_at_epoch_end(self, epoch: int, step: int) -> set[str]:
        """The duties of the end of epoch ``epoch`` (reached at ``step``): each is due when its epoch period divides
        the epoch or its step period divides the step."""
        return {name for name, (by_epoch, by_step) in self.at_epoch_end.items()
                if by_epoch and epoch % by_epoch == 0 or by_step and step % by_step == 0}

    def start(self, step: int) -> None:
        """Training continues after ``step`` (0, or a resumed run's)."""
        self.next = self._after(step)

    def due(self, step: int) -> set[str]:
        """The duties of ``step`` (``max_steps`` once the limit is reached); moves ``next`` on."""
        names = {name for name, every in self.periods.items() if step % every == 0}
        if step >= self.last_step:
            names.add("max_steps")
        self.next = self._after(step)
        return names

    def set_period(self, name: str, every: int, step: int) -> None:
        """Change one period (0 removes it), from ``step`` on."""
        if every:
            self.periods[name] = every
        else:
            self.periods.pop(name, None)
        self.next = self._after(step)

    def _after(self, step: int) -> int:
        nxt = min(((step // every + 1) * every for every in self.periods.values()), default=NEVER)
        return min(nxt, self.last_step) if self.last_step > step else nxt


class Clock:
    """Rank 0's time-based log lines without reading the clock every step: it is read every ``period`` steps, a
    period re-estimated at each reading so that readings come about once a second."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last_line = time.monotonic()
        self._read_at, self._read_step = self.last_line, 0

    def reading(self, step: int) -> tuple[bool, int]:
        """``(a line is due, the next period in steps)`` at ``step``."""
        now = time.monotonic()
        rate = (step - self._read_step) / max(now - self._read_at, 1e-6)
        self._read_at, self._read_step = now, step
        period = max(1, min(int(rate * min(1.0, self.seconds / 4)), 10_000))
        return now - self.last_line >= self.seconds, period

    def lined(self) -> None:
        """A line was printed now (by the clock or by the step count)."""
        self.last_line = time.monotonic()

"""Which step-periodic duties fall on which optimizer step: ``Schedule``.

The loop's hot path compares the step with one precomputed number (``schedule.next``); only at that step does it
ask ``Schedule.due`` which duties it is for -- a log line, the progress bar, validation, a checkpoint, the stop
agreement, the step limit, the ``optimizer_step`` callbacks. Duties that involve every rank have the same periods
on every rank; rank-local ones (the clock behind time-based log lines, the bar) may differ. Torch-free.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Schedule", "Clock", "NEVER"]

NEVER = sys.maxsize


class Schedule:
    """Duties by period (in optimizer steps), plus one absolute step (the step limit)."""

    def __init__(self, periods: dict[str, int], last_step: int = NEVER) -> None:
        self.periods = {name: every for name, every in periods.items() if every}
        self.last_step = last_step
        self.next = NEVER

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

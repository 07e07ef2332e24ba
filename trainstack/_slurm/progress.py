"""A running job's progress and ETA, read from its log's last live line (never from the job itself).

The Trainer's live line says ``epoch 2/10 | step 150/400 | loss ... | 812 samples/s | eta 00:05:10``, where
``eta = (total steps - step) / steps per second over the line's interval``. ``trainstack status`` takes the time
since the line was written (the log's last write) off it: ``remaining = max(eta - age, 0)``.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._common.text import duration

__all__ = ["Progress", "progress_of"]

_STEP = re.compile(r"\bstep (\d+)(?:/(\d+))?")
_EPOCH = re.compile(r"^epoch (\d+(?:\.\d+)?)(?:/(\d+))?")
_RATE = re.compile(r"\| ([\d,.]+) (samples|tokens|batches)/s\b")
_ETA = re.compile(r"\| eta (?:(\d+):(\d\d):(\d\d)|([\d.]+) d)\b")


@dataclass
class Progress:
    """Where a run stands: step (of total), epoch (of total), throughput, and the ETA as of now."""

    step: int
    total_steps: int | None
    epoch: float | None  # as the live line says it: 3 after three passes, 3.5 half-way into the fourth
    total_epochs: int | None
    rate: str  # "812 samples/s"
    eta_s: float | None  # seconds left, as of now (the line's ETA less its age)
    age_s: float  # how old the line is

    @classmethod
    def from_dict(cls, data: dict) -> Progress:
        """A progress another trainstack version sent (``as_dict``): keys this one does not know are ignored, missing
        ones are empty -- a newer remote never breaks an older laptop's table."""
        def number(key: str, kind: type) -> Any:
            value = data.get(key)
            return kind(value) if isinstance(value, (int, float)) else None

        return cls(number("step", int) or 0, number("total_steps", int), number("epoch", float),
                   number("total_epochs", int), str(data.get("rate") or ""), number("eta_s", float),
                   number("age_s", float) or 0.0)

    def text(self) -> str:
        """``38% step 150/400, 812 samples/s, eta 00:05:10``."""
        head = f"{self._percent()} step {self.step}/{self.total_steps}" if self.total_steps else f"step {self.step}"
        return ", ".join([head, *([self.rate] if self.rate else []), *self._eta()])

    def cell(self) -> str:
        """The table's PROGRESS cell: ``38% eta 00:05:10`` (``step 150`` without a total)."""
        return " ".join([self._percent() or f"step {self.step}", *self._eta()])

    def _percent(self) -> str:
        return f"{100 * self.step / self.total_steps:.0f}%" if self.total_steps else ""

    def _eta(self) -> list[str]:
        return [f"eta {duration(self.eta_s)}"] if self.eta_s is not None else []

    def as_dict(self) -> dict:
        return asdict(self)


def progress_of(metric_line: str, log: Path | None, now: float | None = None) -> Progress | None:
    """The progress in a live line (None without a step); ``log``'s last write dates the line."""
    step = _STEP.search(metric_line)
    if step is None:
        return None
    epoch, rate, eta = _EPOCH.search(metric_line), _RATE.search(metric_line), _ETA.search(metric_line)
    try:
        age = max((now or time.time()) - log.stat().st_mtime, 0.0) if log is not None else 0.0
    except OSError:
        age = 0.0
    left = None
    if eta is not None:
        left = float(eta[4]) * 86400 if eta[4] else int(eta[1]) * 3600 + int(eta[2]) * 60 + int(eta[3])
        left = max(left - age, 0.0)
    return Progress(int(step[1]), int(step[2]) if step[2] else None, float(epoch[1]) if epoch else None,
                    int(epoch[2]) if epoch and epoch[2] else None, f"{rate[1]} {rate[2]}/s" if rate else "", left, age)


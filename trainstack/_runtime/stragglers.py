"""Straggler detection: rank 0's watchdog compares every rank's recent time per step in each local phase.

Each heartbeat carries the rank's cumulative seconds per phase and its finished steps (``Heartbeat.times``: a
clock read at each phase change, no host sync, no collective). Every watchdog interval rank 0 turns the last
``WINDOW`` intervals into seconds per step for the phases a rank spends on its own -- ``data`` (waiting for its
loader), ``forward``, ``optimizer`` -- and compares each rank with the median of the ranks on the other nodes (of
the other ranks, on one node): a whole slow node, half the ranks of a two-node job, stands out against the other
node, not against a median it drags itself. ``backward`` is shown but never compared: under DDP it holds the
gradient all-reduce, where the fast ranks wait for the slow one. A rank slower by ``ratio`` (and by at least
``MIN_EXCESS_S`` a step) in ``PERSIST`` readings running is named -- a blip within one interval never is; ranks
uniformly slow move the baseline with them and are never flagged. A named rank is cleared once its *latest*
interval alone keeps pace in ``CLEAR_PERSIST`` readings running (the rolling window would still hold its slow past),
with the step it is cleared at. Torch-free.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from .._common import envvars as envvars

__all__ = ["Straggler", "Stragglers", "COMPARED", "DEFAULT_RATIO"]

COMPARED = ("data", "forward", "optimizer")
SHOWN = (*COMPARED, "backward")
DEFAULT_RATIO = 1.5
MIN_EXCESS_S = 0.002  # below this a step's difference is noise, whatever the ratio
WINDOW = 2  # intervals of the rolling window
PERSIST = 3  # readings in a row before a rank is named: a blip inside one interval never is
CLEAR_PERSIST = 2  # readings in a row of its latest interval keeping pace before a named rank is cleared
MIN_STEPS = 3  # steps in the window for a rank to be compared at all


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    phase: str
    seconds: float  # its time per step in the phase
    baseline: float  # the median rank of the other nodes (of the other ranks, on one node)
    step: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline if self.baseline > 0 else float("inf")

    def describe(self) -> str:
        return (f"rank {self.rank} ({self.host}) is {self.ratio:.1f}x slower in {self.phase}: "
                f"{1000 * self.seconds:.1f} ms per step vs {1000 * self.baseline:.1f} ms for the others")

    def fields(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "phase": self.phase, "ratio": round(self.ratio, 2),
                "ms_per_step": round(1000 * self.seconds, 2), "baseline_ms": round(1000 * self.baseline, 2),
                "step": self.step}


def resolve_ratio() -> float:
    """``TRAINSTACK_STRAGGLER_RATIO`` (default 1.5; 0 turns detection off); a bad value is a ConfigError."""
    try:
        ratio = envvars.positive_number(envvars.STRAGGLER_RATIO, DEFAULT_RATIO, allow_zero=True)
    except ValueError as exc:
        from ..errors import ConfigError

        raise ConfigError(f"{exc} (e.g. 1.5: a rank 1.5x slower than the others is named; 0 turns it off).") from None
    if 0 < ratio <= 1:
        from ..errors import ConfigError

        raise ConfigError(f"{envvars.STRAGGLER_RATIO}={ratio:g} would name ranks no slower than the others: use a "
                          f"ratio above 1 (e.g. 1.5), or 0 to turn straggler detection off.")
    return ratio


class Stragglers:
    """Rank 0's rolling view; ``observe`` each interval returns (newly named, cleared)."""

    def __init__(self, ratio: float = DEFAULT_RATIO) -> None:
        self.ratio = ratio
        self._history: dict[int, deque[tuple[int, dict[str, float]]]] = {}
        self._hits: dict[int, int] = {}
        self._misses: dict[int, int] = {}
        self.named: dict[int, Straggler] = {}

    def observe(self, everyone: dict[int, dict[str, Any]]) -> tuple[list[Straggler], list[Straggler]]:
        if not self.ratio:
            return [], []
        rates, latest = self._rates(everyone)
        slow = self._slowest(rates, everyone)
        slow_now = self._slowest(latest, everyone)
        new, cleared = [], []
        for rank in set(rates) | set(self.named):
            if rank in self.named:
                if rank in slow_now:
                    self._misses[rank] = 0
                    self.named[rank] = slow_now[rank]  # its latest figures
                else:
                    self._misses[rank] = self._misses.get(rank, 0) + 1
                    if self._misses[rank] >= CLEAR_PERSIST:
                        gone = self.named.pop(rank)
                        step = int(everyone.get(rank, {}).get("step") or gone.step)
                        cleared.append(Straggler(gone.rank, gone.host, gone.phase, gone.seconds, gone.baseline, step))
                        self._hits[rank] = 0
                continue
            if rank in slow:
                self._hits[rank] = self._hits.get(rank, 0) + 1
                if self._hits[rank] >= PERSIST:
                    self.named[rank], self._misses[rank] = slow[rank], 0
                    new.append(slow[rank])
            else:
                self._hits[rank] = 0
        return new, cleared

    def _rates(self, everyone: dict[int, dict[str, Any]]
               ) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
        """Each rank's seconds per step and phase over the window, and over its latest interval alone (ranks with
        too few steps in either left out)."""
        window: dict[int, dict[str, float]] = {}
        latest: dict[int, dict[str, float]] = {}
        for rank, beat in everyone.items():
            spent, beats = beat.get("spent"), beat.get("beats")
            if not isinstance(spent, dict) or not isinstance(beats, int):
                continue
            history = self._history.setdefault(rank, deque(maxlen=WINDOW + 1))
            history.append((beats, {k: float(v) for k, v in spent.items()}))
            for out, (b0, s0) in ((window, history[0]), (latest, history[-2] if len(history) > 1 else history[0])):
                b1, s1 = history[-1]
                if b1 - b0 >= MIN_STEPS:
                    out[rank] = {p: (s1.get(p, 0.0) - s0.get(p, 0.0)) / (b1 - b0) for p in SHOWN}
        return window, latest

    def _slowest(self, rates: dict[int, dict[str, float]],
                 everyone: dict[int, dict[str, Any]]) -> dict[int, Straggler]:
        """The ranks slower than the others in a compared phase, each with its worst phase."""
        if len(rates) < 2:
            return {}
        found: dict[int, Straggler] = {}
        hosts = {rank: everyone[rank].get("host") for rank in rates}
        for phase in COMPARED:
            for rank, r in rates.items():
                others = [o[phase] for q, o in rates.items() if hosts[q] != hosts[rank]] or \
                    [o[phase] for q, o in rates.items() if q != rank]
                baseline = statistics.median(others)
                excess = r[phase] - baseline
                if excess >= MIN_EXCESS_S and r[phase] >= self.ratio * baseline:
                    candidate = Straggler(rank, str(everyone[rank].get("host")), phase, r[phase], baseline,
                                          int(everyone[rank].get("step") or 0))
                    if rank not in found or excess > found[rank].seconds - found[rank].baseline:
                        found[rank] = candidate
        return found

"""Where the current epoch stands, and how a resumed run gets back there: ``EpochCursor``.

A checkpoint written mid-epoch records the position both as batches of this layout and as *global samples* of the
epoch's order, which any number of processes can continue: the same world size continues bitwise at its batch
with the partial sums; another world size starts a new segment of the epoch at the same global sample (nothing
skipped or repeated) and re-derives each rank's RNG. Torch-free arithmetic, unit-testable without processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..data import epoch_batches

__all__ = ["EpochCursor", "derived_seed"]

log = logging.getLogger(__name__)


@dataclass
class EpochCursor:
    """The resume position of one rank: one object instead of six loose attributes.

    ``batch`` batches of the epoch are done (replayed or jumped over when the epoch starts), with ``totals`` (the
    partial loss and metric sums) and ``pending_rng`` (restored once the epoch's iterator exists, since creating it
    draws from the global RNG). ``samples`` is the global sample to jump to; ``base`` the global samples consumed
    before this segment of the epoch. ``saved`` is the position a mid-epoch stop records.
    """

    batch: int = 0
    totals: dict[str, Any] = field(default_factory=dict)
    pending_rng: dict[str, Any] | None = None
    samples: Any = None
    base: Any = 0
    saved: dict[str, Any] | None = None
    interval_source: Callable[[], dict[str, Any]] | None = None  # where the open log interval began, when asked

    def take(self, partial: dict[str, Any], saved_world: int, world: int, samples_per_step: Any) -> bool:
        """Continue a stopped epoch where it stopped; True when the layout changed (another number of processes)."""
        n = int(partial.get("batch_in_epoch", 0))
        self.batch, self.totals, self.base, self.samples = n, partial, 0, None
        samples = partial.get("samples_in_epoch")
        spb = samples_per_step
        if not n or spb is None:
            if n and saved_world != world:
                log.warning("this loader cannot jump to a global sample position: the %d batches already trained "
                            "in the stopped epoch are replayed per rank.", n)
            return saved_world != world
        if samples is None:  # a checkpoint from before global positions: batches of the same layout
            samples = {k: n * v // world * saved_world for k, v in spb.items()} if isinstance(spb, dict) \
                else n * spb // world * saved_world
        self.samples = samples
        if saved_world == world:
            self.base = {k: v - n * spb[k] for k, v in samples.items()} if isinstance(spb, dict) \
                else samples - n * spb
            return False
        self.batch, self.totals, self.base = 0, {}, samples  # a new segment of the epoch
        return True

    def resume(self, restored: Any, world: int, samples_per_step: Any, derived: int, persistent: bool = False) -> str:
        """Take a checkpoint's position and RNG; returns where it continues, in words (for the "Resumed" line).

        The same layout restores this rank's RNG -- once the epoch's iterator exists when mid-epoch, or when the
        loader keeps ``persistent`` workers (an uninterrupted run only resets its iterator at an epoch's start,
        while a resumed one creates it, drawing from the RNG) --; another layout re-seeds every rank from
        ``derived`` (the seed, the rank and the step: repeatable).
        """
        from ..accelerator import seed_everything
        from ..checkpoint import restore_rng

        partial = restored.counters.get("partial_epoch") or {}
        resharded = self.take(partial, restored.world_size, world, samples_per_step)
        if restored.rng is not None and not resharded:
            if self.batch or persistent:
                self.pending_rng = restored.rng
            else:
                restore_rng(restored.rng)
        else:
            seed_everything(derived)
        where = f", batch {self.batch} of the epoch" if self.batch else ""
        if restored.world_size != world:
            where += (f"; resharded: written by {restored.world_size} process(es), continuing on {world} at global "
                      f"sample {self.samples or 0} of the epoch, RNG re-derived")
        return where

    def begin(self, loader: Any, per_epoch: int | None, capped: bool) -> tuple[int, dict[str, Any],
                                                                                Iterator[Any], int | None]:
        """Start (the rest of) an epoch: ``(batches done, partial sums, iterator, batches left)``; the resume
        position is consumed. A prepared loader jumps to the saved global sample without loading what it skips;
        any other loader replays the done batches."""
        n, totals = self.batch, self.totals
        cap = per_epoch if capped else None
        if self.samples is not None and getattr(loader, "can_skip", False):
            loader.skip_samples(self.samples)
            left = loader.batches_next_pass() if cap is None else min(loader.batches_next_pass(), cap - n)
            batches = iter(epoch_batches(loader, 0, left if cap is not None else None))
        else:
            left = None if per_epoch is None else per_epoch - n
            batches = iter(epoch_batches(loader, n, left if cap is not None else None))
        self.batch, self.totals, self.samples = 0, {}, None
        return n, totals, batches, left

    def end_epoch(self) -> None:
        """The next epoch starts at its first sample."""
        self.base = 0

    def position(self, n: int, samples_per_step: Any, world: int) -> dict[str, Any]:
        """Where this epoch stands after ``n`` batches: also as global samples, which any world size can continue."""
        spb, base = samples_per_step, self.base
        if spb is None:
            samples = None
        elif isinstance(spb, dict):
            samples = {k: (base.get(k, 0) if isinstance(base, dict) else 0) + n * v for k, v in spb.items()}
        else:
            samples = base + n * spb
        return {"batch_in_epoch": n, "samples_in_epoch": samples, "world_size": world}

    def stop_at(self, n: int, samples_per_step: Any, world: int, loss_sum: Any, sums: dict[str, Any],
                interval: Callable[[], dict[str, Any]] | None = None) -> None:
        """Record the position of a stop after ``n`` batches of this epoch, with its partial sums; ``interval`` says,
        when a checkpoint is written, where the open log interval began then (a row due at this step is written
        before the checkpoint: the resumed run's next row averages the same steps as the uninterrupted run's)."""
        self.saved = {**self.position(n, samples_per_step, world), "loss_sum": loss_sum, "sums": sums}
        self.interval_source = interval

    def checkpoint(self) -> dict[str, Any]:
        """What a checkpoint stores as the position inside the current epoch."""
        if not self.saved:
            return {"batch_in_epoch": 0}
        source = self.interval_source
        return {**self.saved, "interval": source() if source is not None else None}


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A per-rank seed for a resharded resume: deterministic, and different per rank and per step."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (2**31 - 1)

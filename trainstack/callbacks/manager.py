"""Dispatch events to the user's callbacks cheaply (lists per event; the hot loop asks for periods)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._runtime.watchdog import phase
from .base import EVENTS, Callback

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["CallbackManager"]


class CallbackManager:
    """Holds callbacks by event for one rank; ``fire`` does nothing for events nobody listens to."""

    def __init__(self, callbacks: list[Callback], is_main: bool) -> None:
        self.callbacks = [cb for cb in callbacks if is_main or not cb.main_process_only]
        self.by_event: dict[str, list[Callback]] = {ev: [] for ev in EVENTS}
        for cb in self.callbacks:
            for event in cb.events:
                self.by_event[event].append(cb)

    def period(self, event: str) -> int:
        """Steps between possible firings of ``event`` (gcd of the intervals; 0: never), for the hot loop."""
        cbs = self.by_event[event]
        if not cbs:
            return 0
        if any(cb.called_every == 0 and cb.on not in ("train_start", "train_end") for cb in cbs):
            cbs = [cb for cb in cbs if cb.called_every]
        return math.gcd(*[cb.called_every for cb in cbs]) if cbs else 0

    def fire(self, event: str, trainer: Trainer, iteration: int | None = None, loss: Any = None,
             metrics: dict[str, Any] | None = None) -> None:
        """Call the callbacks of ``event``; with ``iteration``, ``trainer.opt_result`` first describes it (the
        epoch, the global batch or the optimizer step; ``loss`` and ``metrics`` default to the run's)."""
        if iteration is not None:
            trainer.opt_result.describe(iteration, trainer, loss, metrics)
        callbacks = self.by_event[event]
        if not callbacks:
            return
        with phase("callback"):  # the hang watchdog gives user code the longer allowance
            for cb in callbacks:
                cb(event, trainer, trainer.config, trainer.writer)

    def state_dict(self) -> list[dict[str, Any]]:
        return [cb.state_dict() for cb in self.callbacks]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.callbacks):
            return  # a different callback set: keep fresh state rather than mis-assign it
        for cb, st in zip(self.callbacks, states, strict=True):
            cb.load_state_dict(st)

"""Wire the default callbacks from a TrainConfig and dispatch events cheaply (lists per event)."""

from __future__ import annotations

from typing import Any

from .base import EVENTS, Callback
from .builtin import (
    LogHyperparameters,
    LogModelTracker,
    PlotMetrics,
    PrintMetrics,
    SaveBestCheckpoint,
    SaveCheckpoint,
    WriteMetrics,
)

__all__ = ["CallbackManager", "default_callbacks"]


def default_callbacks(config: Any) -> list[Callback]:
    """The callbacks a TrainConfig asks for (after the user's own, which run first)."""
    cbs: list[Callback] = []
    if config.verbose and config.print_every:
        cbs.append(PrintMetrics(on="train_epoch_end", called_every=config.print_every))
    cbs.append(WriteMetrics(on="train_epoch_end", called_every=config.write_every or 1))
    if config.plot_every:
        cbs.append(PlotMetrics(on="train_epoch_end", called_every=config.plot_every))
        cbs.append(PlotMetrics(on="train_end"))
    if config.checkpoint_best_only:
        cbs.append(SaveBestCheckpoint(on="val_epoch_end", called_every=1))
    else:
        if config.checkpoint_every:
            cbs.append(SaveCheckpoint(on="train_epoch_end", called_every=config.checkpoint_every))
        cbs.append(SaveCheckpoint(on="train_end"))  # always leave the final state on disk
    if config.hyperparams:
        cbs.append(LogHyperparameters(on="train_end"))
    if config.log_model:
        cbs.append(LogModelTracker(on="train_end"))
    return cbs


class CallbackManager:
    """Holds callbacks by event for one rank; ``fire`` does nothing for events nobody listens to."""

    def __init__(self, callbacks: list[Callback], is_main: bool) -> None:
        self.callbacks = [cb for cb in callbacks if is_main or not cb.main_process_only]
        self.by_event: dict[str, list[Callback]] = {ev: [] for ev in EVENTS}
        for cb in self.callbacks:
            self.by_event[cb.on].append(cb)

    def has(self, event: str) -> bool:
        return bool(self.by_event[event])

    def period(self, event: str) -> int:
        """Steps between possible firings of ``event`` (gcd of the intervals; 0: never), for the hot loop."""
        import math

        cbs = self.by_event[event]
        if not cbs:
            return 0
        if any(cb.called_every == 0 and cb.on not in ("train_start", "train_end") for cb in cbs):
            cbs = [cb for cb in cbs if cb.called_every]
        return math.gcd(*[cb.called_every for cb in cbs]) if cbs else 0

    def fire(self, event: str, trainer: Any) -> None:
        for cb in self.by_event[event]:
            cb(event, trainer, trainer.config, trainer.writer)

    def state_dict(self) -> list[dict[str, Any]]:
        return [cb.state_dict() for cb in self.callbacks]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) != len(self.callbacks):
            return  # a different callback set: keep fresh state rather than mis-assign it
        for cb, st in zip(self.callbacks, states, strict=True):
            cb.load_state_dict(st)

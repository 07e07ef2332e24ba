"""Callback events, the `Callback` class and the `OptimizeResult` it sees (qadence-compatible)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["EVENTS", "Callback", "OptimizeResult"]

EVENTS = ("train_start", "train_end", "train_epoch_start", "train_epoch_end", "train_batch_start",
          "train_batch_end", "optimizer_step", "val_epoch_start", "val_epoch_end", "val_batch_start", "val_batch_end",
          "test_batch_start", "test_batch_end")
_ALWAYS = ("train_start", "train_end")


@dataclass
class OptimizeResult:
    """What callbacks see: ``iteration`` is the epoch (epoch events), the global batch (batch events) or the optimizer
    step (``optimizer_step``)."""

    iteration: int
    model: Any
    optimizer: Any
    loss: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    device: Any = "cpu"

    def describe(self, iteration: int, trainer: Trainer, loss: Any = None, metrics: dict[str, Any] | None = None
                 ) -> None:
        """The state at ``iteration``: the trainer's model, optimizer, process; its training loss and metrics unless
        given (a batch's own)."""
        self.iteration, self.model, self.optimizer = iteration, trainer.model, trainer.optimizer
        self.loss = trainer.metrics.get("train_loss") if loss is None else loss
        self.metrics = trainer.metrics if metrics is None else metrics
        self.rank, self.device = trainer.accelerator.rank, trainer.accelerator.device


class Callback:
    """Run ``callback(trainer, config, writer)`` on event ``on`` every ``called_every`` iterations.

    Args:
        on: one of ``EVENTS``.
        called_every: fire when ``iteration % called_every == 0`` (0 disables; start/end events always fire).
        callback: the function to run (subclasses override ``run_callback`` instead).
        callback_condition: ``(opt_result) -> bool``; fire only when true.
        modify_optimize_result: a function ``(opt_result) -> None`` or a dict merged into ``opt_result.extra``.
    """

    #: Logging, plotting and file-writing callbacks run on rank 0 only; training-affecting ones on all ranks.
    main_process_only: ClassVar[bool] = False

    def __init__(self, on: str = "train_epoch_end", called_every: int = 1, callback: Callable | None = None,
                 callback_condition: Callable[[OptimizeResult], bool] | None = None,
                 modify_optimize_result: Callable | dict | None = None) -> None:
        on = getattr(on, "value", on)
        if on not in EVENTS:
            raise ConfigError(f"{type(self).__name__}(on={on!r}): must be one of {EVENTS}.")
        if isinstance(called_every, bool) or not isinstance(called_every, int) or called_every < 0:
            raise ConfigError(f"{type(self).__name__}(called_every={called_every!r}): must be an integer >= 0.")
        for name, value in (("callback", callback), ("callback_condition", callback_condition)):
            if value is not None and not callable(value):
                raise ConfigError(f"{type(self).__name__}({name}={value!r}): must be a function.")
        if modify_optimize_result is not None and not (callable(modify_optimize_result)
                                                       or isinstance(modify_optimize_result, dict)):
            raise ConfigError(f"{type(self).__name__}(modify_optimize_result=...): must be a function or a dict.")
        self.on = on
        self.called_every = called_every
        self.callback = callback
        self.callback_condition = callback_condition
        self.modify_optimize_result = modify_optimize_result

    @property
    def events(self) -> tuple[str, ...]:
        """The events this callback listens to (one, ``on``, unless a subclass listens to several)."""
        return (self.on,)

    def should_call(self, opt_result: OptimizeResult) -> bool:
        if self.on in _ALWAYS:
            return self.callback_condition is None or bool(self.callback_condition(opt_result))
        it = opt_result.iteration
        if self.called_every == 0 or it == 0 or it % self.called_every:
            return False
        return self.callback_condition is None or bool(self.callback_condition(opt_result))

    def __call__(self, when: str, trainer: Any, config: Any, writer: Any) -> Any:
        if when != self.on:
            return None
        opt_result = trainer.opt_result
        if isinstance(self.modify_optimize_result, dict):
            opt_result.extra.update(self.modify_optimize_result)
        elif self.modify_optimize_result is not None:
            self.modify_optimize_result(opt_result)
        if self.should_call(opt_result):
            return self.run_callback(trainer, config, writer)
        return None

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> Any:
        if self.callback is None:
            raise NotImplementedError(f"{type(self).__name__}: pass callback=fn or override run_callback().")
        return self.callback(trainer, config, writer)

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (e.g. best loss, patience counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(on={self.on!r}, called_every={self.called_every})"

"""qadence's switches on the Trainer: gradient-based or gradient-free (nevergrad) training, class-wide or for a
block, and the refusal of qadence's ``on_*`` hook methods, which trainstack never calls (a silent no-op would train
something else than the user wrote)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from .steps import check_step_options, is_custom_step

if TYPE_CHECKING:
    from ..trainer import Trainer

__all__ = ["check_optimizer", "grad_mode", "refuse_qadence_hooks", "QADENCE_HOOKS", "UseGrad", "set_use_grad",
           "enable_grad_opt", "disable_grad_opt", "GradModes"]

QADENCE_HOOKS = ("on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
                 "on_val_epoch_start", "on_val_epoch_end", "on_train_batch_start", "on_train_batch_end",
                 "on_val_batch_start", "on_val_batch_end", "on_test_batch_start", "on_test_batch_end")


class UseGrad:
    """``trainer.use_grad``: this Trainer's own value once set, else the class-wide one (``Trainer.set_use_grad``)."""

    def __get__(self, trainer: Trainer | None, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return trainer.__dict__.get("_use_grad_instance", type(trainer)._use_grad)

    def __set__(self, trainer: Trainer, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"use_grad must be True or False, got {value!r}.")
        trainer.__dict__["_use_grad_instance"] = value


def check_optimizer(optimizer: Any, use_grad: bool) -> None:
    """A torch optimizer with gradients, a nevergrad one (ask/tell) without."""
    if use_grad and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer (use_grad=True), got "
                          f"{type(optimizer).__name__}.")
    if not use_grad and not (hasattr(optimizer, "ask") and hasattr(optimizer, "tell")):
        raise ConfigError(f"gradient-free training (use_grad=False) needs a nevergrad optimizer, e.g. "
                          f"ng.optimizers.NGOpt(parametrization=n_params, budget=max_iter), got "
                          f"{type(optimizer).__name__}.")


def set_use_grad(cls: Any, value: bool) -> None:
    """``Trainer.set_use_grad(False)``: class-wide, train with a gradient-free nevergrad optimizer (as qadence)."""
    if not isinstance(value, bool):
        raise ConfigError(f"Trainer.set_use_grad expects True or False, got {value!r}.")
    cls._use_grad = value


@contextlib.contextmanager
def enable_grad_opt(trainer: Trainer, optimizer: Any = None) -> Iterator[Trainer]:
    """``with trainer.enable_grad_opt(): trainer.fit(...)`` trains with gradients (optionally ``optimizer``); the
    previous mode and optimizer come back afterwards (qadence)."""
    with grad_mode(trainer, True, optimizer):
        yield trainer


@contextlib.contextmanager
def disable_grad_opt(trainer: Trainer, ng_optimizer: Any = None) -> Iterator[Trainer]:
    """``with trainer.disable_grad_opt(ng_optimizer): trainer.fit(...)`` trains gradient-free (nevergrad)."""
    with grad_mode(trainer, False, ng_optimizer):
        yield trainer


@contextlib.contextmanager
def grad_mode(trainer: Trainer, use_grad: bool, optimizer: Any) -> Iterator[None]:
    """Train with (or without) gradients, optionally with another optimizer, for the block; both come back."""
    saved = (trainer.__dict__.get("_use_grad_instance"), trainer.optimizer)
    trainer.use_grad = use_grad
    if optimizer is not None:
        trainer.optimizer = optimizer
    try:
        check_optimizer(trainer.optimizer, use_grad)
        check_step_options(trainer.config, trainer.optimizer, is_custom_step(trainer.optimize_step), use_grad)
        yield
    finally:
        if saved[0] is None:
            trainer.__dict__.pop("_use_grad_instance", None)
        else:
            trainer.__dict__["_use_grad_instance"] = saved[0]
        trainer.optimizer = saved[1]


def refuse_qadence_hooks(cls: type, base: type) -> None:
    """qadence calls ``on_*`` methods of a Trainer subclass; trainstack does not, so overriding one would be
    silently ignored. Say so, with the callback that does the same."""
    overridden = [name for name in QADENCE_HOOKS if any(name in vars(k) for k in cls.__mro__ if k is not base)]
    if overridden:
        event = overridden[0][3:]
        raise ConfigError(f"{cls.__name__} overrides {', '.join(overridden)}, which trainstack never calls (qadence "
                          f"did). HINT: use a callback instead: TrainConfig(callbacks=[Callback(on={event!r}, "
                          f"callback=lambda trainer, config, writer: ...)]).")


class GradModes:
    """qadence's gradient-mode switches, as a Trainer has them: ``use_grad`` (this Trainer's), ``set_use_grad``
    (every Trainer's), ``enable_grad_opt`` / ``disable_grad_opt`` (for a block)."""

    use_grad = UseGrad()
    set_use_grad = classmethod(set_use_grad)
    enable_grad_opt = enable_grad_opt
    disable_grad_opt = disable_grad_opt

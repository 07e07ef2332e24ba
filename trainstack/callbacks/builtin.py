"""Built-in callbacks. Logging/plotting ones run on rank 0; training-affecting ones on every rank."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .base import Callback

#: Where monitored metric names come from (the hint of EarlyStopping and ModelCheckpoint).
METRIC_NAMES = ("validation metrics are val_<name> and training ones train_<name> (from loss_fn's metrics); "
                "trainer.log(name, value) adds your own, visible to every callback from where it is logged (a value "
                "logged in a val_epoch_end callback before this one included).")

__all__ = ["METRIC_NAMES", "PrintMetrics", "WriteMetrics", "PlotMetrics", "LogHyperparameters", "LogModelTracker",
           "SaveCheckpoint", "LoadCheckpoint", "EarlyStopping", "GradientMonitoring",
           "LRScheduler", "LRSchedulerStepDecay", "LRSchedulerCyclic", "LRSchedulerCosineAnnealing"]


class PrintMetrics(Callback):
    """One line from rank 0: ``epoch N | step S | train_loss: ... | val_loss: ...`` (``batch N | ...`` on batch
    events)."""

    main_process_only = True

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        from .._runtime.writers import format_metrics

        result, step = trainer.opt_result, getattr(trainer, "global_step", None)
        line = format_metrics(result.iteration, result.metrics, step)
        trainer.console_print(line.replace("epoch", "batch", 1) if "batch" in self.on else line)


class WriteMetrics(Callback):
    main_process_only = True

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        writer.write(trainer.opt_result.iteration, trainer.opt_result.metrics)


class PlotMetrics(Callback):
    main_process_only = True

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        writer.plot(trainer.unwrapped_model, trainer.opt_result.iteration, config.plotting_functions)


class LogHyperparameters(Callback):
    main_process_only = True

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        writer.log_hyperparams(config.hyperparams)


class LogModelTracker(Callback):
    main_process_only = True

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        writer.log_model(trainer.unwrapped_model)


class SaveCheckpoint(Callback):
    """Save a complete checkpoint (every rank takes part: RNG states are gathered); returns its file."""

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> Any:
        return trainer.save_checkpoint()


class LoadCheckpoint(Callback):
    """Load a checkpoint on every rank at ``train_start`` (``path=None``: the latest of the run folder); returns
    qadence's ``(model, optimizer, epoch)``, or None (said) when there was none."""

    def __init__(self, on: str = "train_start", called_every: int = 1, path: Any = None, **kwargs: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kwargs)
        self.path = path

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> Any:
        if not trainer.load_checkpoint(self.path):
            trainer.console_print(f"trainstack: LoadCheckpoint: no checkpoint to load in {trainer.run_folder}; the "
                                  f"model is unchanged.")
            return None
        return trainer.model, trainer.optimizer, trainer.current_epoch


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved for ``patience`` calls; every rank stops at the same epoch."""

    def __init__(self, on: str = "val_epoch_end", called_every: int = 1, monitor: str = "val_loss",
                 patience: int = 5, mode: str = "min", min_delta: float = 0.0, **kwargs: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kwargs)
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping(mode={mode!r}): must be 'min' or 'max'.")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping(patience={patience!r}): must be an integer >= 1.")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        metrics = dict(getattr(trainer, "callback_metrics", None) or trainer.opt_result.metrics)
        if self.monitor not in metrics:
            raise ConfigError(f"EarlyStopping: metric {self.monitor!r} not found; available: {sorted(metrics)}. "
                              f"HINT: {METRIC_NAMES}")
        value = float(metrics[self.monitor])
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.request_stop(f"EarlyStopping: {self.monitor} did not improve for {self.patience} checks")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = float(state.get("best", self.best)), int(state.get("wait", 0))


class GradientMonitoring(Callback):
    """Write mean/std/max/min of every parameter's gradient (rank 0; gradients are synchronised)."""

    main_process_only = True

    def __init__(self, on: str = "train_batch_end", called_every: int = 1, **kwargs: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kwargs)

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        stats: dict[str, float] = {}
        for name, p in trainer.unwrapped_model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().float()
                stats.update({f"{name}_mean": g.mean().item(), f"{name}_std": g.std().item() if g.numel() > 1
                              else 0.0, f"{name}_max": g.max().item(), f"{name}_min": g.min().item()})
        writer.write(trainer.opt_result.iteration, stats)


class LRScheduler(Callback):
    """Step any ``torch.optim.lr_scheduler`` on an event (its state is checkpointed): ``optimizer_step`` after every
    optimizer step, ``train_epoch_end`` after every epoch. On ``train_batch_end`` it steps only after batches that
    completed an optimizer step (gradient accumulation), so it never runs ahead of the optimizer."""

    def __init__(self, scheduler: Any, on: str = "train_epoch_end", called_every: int = 1, **kwargs: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kwargs)
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
            raise ConfigError(f"LRScheduler({scheduler!r}): expected a torch.optim.lr_scheduler object.")
        self.scheduler = scheduler

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        run = getattr(trainer, "run", None)
        if self.on == "train_batch_end" and run is not None and not run.step.at_boundary:
            return  # half an accumulated optimizer step: the learning rate has not been used yet
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


class _LRFunction(Callback):
    """Set the learning rate of every param group from ``new_lr(current_lr, iteration)``."""

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> None:
        it = trainer.opt_result.iteration
        for group in trainer.optimizer.param_groups:
            group["lr"] = self.new_lr(group["lr"], it)

    def new_lr(self, lr: float, iteration: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError


class LRSchedulerStepDecay(_LRFunction):
    def __init__(self, on: str = "train_epoch_end", called_every: int = 1, gamma: float = 0.5, **kw: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kw)
        self.gamma = gamma

    def new_lr(self, lr: float, iteration: int) -> float:
        return lr * self.gamma


class LRSchedulerCyclic(_LRFunction):
    def __init__(self, on: str = "train_batch_end", called_every: int = 1, base_lr: float = 1e-3,
                 max_lr: float = 1e-2, step_size: int = 2000, **kw: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kw)
        if step_size < 1:
            raise ConfigError(f"LRSchedulerCyclic(step_size={step_size!r}): must be >= 1.")
        self.base_lr, self.max_lr, self.step_size = base_lr, max_lr, step_size

    def new_lr(self, lr: float, iteration: int) -> float:
        cycle = math.floor(1 + iteration / (2 * self.step_size))
        x = abs(iteration / self.step_size - 2 * cycle + 1)
        return self.base_lr + (self.max_lr - self.base_lr) * max(0.0, 1 - x)


class LRSchedulerCosineAnnealing(_LRFunction):
    def __init__(self, on: str = "train_epoch_end", called_every: int = 1, t_max: int = 100, min_lr: float = 0.0,
                 **kw: Any) -> None:
        super().__init__(on=on, called_every=called_every, **kw)
        if t_max < 1:
            raise ConfigError(f"LRSchedulerCosineAnnealing(t_max={t_max!r}): must be >= 1.")
        self.t_max, self.min_lr = t_max, min_lr
        self.max_lr: float | None = None

    def new_lr(self, lr: float, iteration: int) -> float:
        if self.max_lr is None:
            self.max_lr = lr
        return self.min_lr + (self.max_lr - self.min_lr) * (1 + math.cos(math.pi * iteration / self.t_max)) / 2

    def state_dict(self) -> dict[str, Any]:
        return {"max_lr": self.max_lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_lr = state.get("max_lr")



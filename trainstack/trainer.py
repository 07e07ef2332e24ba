"""`Trainer`: the training loop. Correct under any number of processes, resumable exactly.

Example::

    from trainstack import Trainer, TrainConfig

    config = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=50, print_every=5)
    model, optimizer = Trainer(model, optimizer, config, loss_fn="mse").fit(dataloader)

The loop (:meth:`Trainer._fit`) fits on one screen; printing, writing, plotting, checkpoints, early stopping
and LR schedules are callbacks (:mod:`trainstack.callbacks`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import collectives
from .accelerator import Accelerator, seed_everything
from .callbacks import CallbackManager, LRScheduler, OptimizeResult, default_callbacks
from .checkpoint import Checkpointer
from .config import TrainConfig
from .data import prepare_dataloader, prepare_eval_dataloader
from .errors import ConfigError, Preempted
from .preemption import GracefulStop, resolve_signals
from .progress import ProgressBar, banner, progress_enabled
from .runfolder import choose_run_folder
from .steps import call_loss, get_loss_fn, optimize_step
from .trainer_state import PREEMPTED, StateMixin
from .trainer_steps import StepsMixin
from .writers import NullWriter, make_writers, save_loss_curve

__all__ = ["Trainer"]

log = logging.getLogger(__name__)


def _fit_entry(trainer: Trainer) -> dict[str, Any] | None:
    """Runs in every process (module-level so it pickles)."""
    return trainer._fit()


def _test_entry(trainer: Trainer, loader: Any) -> dict[str, float]:
    trainer._setup_runtime(for_training=False)
    return trainer._evaluate("test", prepare_eval_dataloader(loader, trainer.accelerator.rank,
                                                              trainer.accelerator.world_size))


class Trainer(StateMixin, StepsMixin):
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` processes.

    ``loss_fn`` is ``"mse"``, ``"cross_entropy"`` or ``(model, batch) -> loss | (loss, metrics)``; metrics are
    reported with ``train_``/``val_``/``test_`` prefixes. ``optimize_step`` defaults to a closure-based step
    (LBFGS works). ``scheduler`` is any ``torch.optim.lr_scheduler``, stepped after every epoch.
    """

    _use_grad: ClassVar[bool] = True

    def __init__(self, model: nn.Module, optimizer: Any, config: TrainConfig, loss_fn: Any = "mse",
                 train_dataloader: Any = None, val_dataloader: Any = None, test_dataloader: Any = None,
                 optimize_step: Any = optimize_step, max_batches: int | None = None, scheduler: Any = None) -> None:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a trainstack TrainConfig, got {type(config).__name__}.")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if self.use_grad and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer (use_grad=True), got {type(optimizer)}.")
        self.model, self.optimizer, self.config = model, optimizer, config
        self.loss_fn = get_loss_fn(loss_fn)
        self.optimize_step = optimize_step
        self.train_dataloader, self.val_dataloader, self.test_dataloader = train_dataloader, val_dataloader, \
            test_dataloader
        self.max_batches = max_batches if max_batches is not None else config.max_batches
        self.scheduler = scheduler
        self.accelerator = Accelerator(nprocs=config.nprocs, compute_setup=config.compute_setup,
                                       log_setup=config.log_setup, dtype=config.dtype, backend=config.backend)
        self._check_step_options()
        self.current_epoch = self.global_step = 0
        self.run_folder: Path | None = None
        self.stop_training, self.stop_reason = False, ""
        self.metrics: dict[str, Any] = {}
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.writer: Any = NullWriter()

    # ------------------------------------------------------------------ public API
    @property
    def use_grad(self) -> bool:
        return self.__dict__.get("_use_grad_instance", type(self)._use_grad)

    @use_grad.setter
    def use_grad(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"use_grad must be True or False, got {value!r}.")
        self.__dict__["_use_grad_instance"] = value

    @classmethod
    def set_use_grad(cls, value: bool) -> None:
        """Class-wide switch: False trains with a gradient-free nevergrad optimizer (as the reference)."""
        if not isinstance(value, bool):
            raise ConfigError(f"Trainer.set_use_grad expects True or False, got {value!r}.")
        cls._use_grad = value

    def fit(self, train_dataloader: Any = None, val_dataloader: Any = None) -> tuple[nn.Module, Any]:
        """Train for ``config.max_iter`` epochs; returns ``(model, optimizer)`` holding rank 0's final state."""
        if train_dataloader is not None:
            self.train_dataloader = train_dataloader
        if val_dataloader is not None:
            self.val_dataloader = val_dataloader
        if self.config.val_every and self.val_dataloader is None:
            raise ConfigError(f"TrainConfig.val_every={self.config.val_every} but no validation DataLoader was "
                              f"given. HINT: fit(train_loader, val_loader) or Trainer(..., val_dataloader=...).")
        result = self.accelerator.distribute(_fit_entry)(self)
        if self.accelerator.plan.spawn and result is not None:
            self._absorb(result)
        if self.stop_reason.startswith(PREEMPTED):
            raise Preempted(f"trainstack: {self.stop_reason}; a complete checkpoint is in {self.run_folder}. "
                            f"Run again with resume='auto' to continue exactly where it stopped.")
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """Evaluate on the given (or constructor) loader, reduced over all ranks without padding duplicates."""
        loader = test_dataloader if test_dataloader is not None else self.test_dataloader
        if loader is None:
            raise ConfigError("test() needs a DataLoader: test(loader) or Trainer(..., test_dataloader=loader).")
        return self.accelerator.distribute(_test_entry)(self, loader)

    @property
    def unwrapped_model(self) -> nn.Module:
        return self.model

    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the current epoch (agreed by an all-reduce)."""
        self.stop_training, self.stop_reason = True, reason

    def console_print(self, text: str) -> None:
        if self.accelerator.is_main_process:
            print(text, flush=True)

    # ------------------------------------------------------------------ the loop
    def _fit(self) -> dict[str, Any] | None:
        cfg = self.config
        try:
            self._setup_runtime(for_training=True)
            self.callbacks.fire("train_start", self)
            while self.current_epoch < cfg.max_iter and not self.stop_training:
                if not self._resume_batch:
                    self.callbacks.fire("train_epoch_start", self)
                self.metrics = self._train_epoch()
                if self.stop_training:  # preempted mid-epoch: checkpoint written, epoch not finished
                    break
                self.current_epoch += 1
                if cfg.val_every and self.current_epoch % cfg.val_every == 0:
                    self._validate()
                self._end_epoch()
            if not self.stop_reason.startswith(PREEMPTED):  # a preempted run has not ended: no final hooks
                self._set_result(self.current_epoch)
                self.callbacks.fire("train_end", self)
        finally:
            self._close()
        return self._export() if self.accelerator.is_main_process else None

    def _train_epoch(self) -> dict[str, Any]:
        model, (loss_sum, sums, n, batches) = self._model, self._start_epoch()
        model.train()
        on_start, on_end = self.callbacks.period("train_batch_start"), self.callbacks.period("train_batch_end")
        poll, prepare_batch = self.config.stop_check_every, self.accelerator.prepare_batch
        for batch in batches:
            batch = prepare_batch(batch)
            if on_start and (self.global_step + 1) % on_start == 0:
                self._set_result(self.global_step + 1)
                self.callbacks.fire("train_batch_start", self)
            loss, metrics = self._step(model, batch)
            n += 1
            self.global_step += 1
            loss_sum = loss if loss_sum is None else loss_sum + loss
            for k, v in metrics.items():
                sums[k] = v.detach() if k not in sums else sums[k] + v.detach()
            if on_end and self.global_step % on_end == 0:
                self._set_result(self.global_step, loss, metrics)
                self.callbacks.fire("train_batch_end", self)
            if self.global_step % poll == 0 and not self._micro and self._preempt_now(n, loss_sum, sums):
                return {}
        return self._epoch_metrics("train", loss_sum, sums, n)

    def _end_epoch(self) -> None:
        self._set_result(self.current_epoch)
        self.callbacks.fire("train_epoch_end", self)
        stop = self.stop_training or bool(self.config.trainstop_criterion and self.config.trainstop_criterion(self))
        local_preempt = self._stopper.requested()
        preempt = bool(local_preempt)
        if self.accelerator.world_size > 1:  # one small collective per epoch keeps every rank in step
            flags = collectives.all_reduce_dict({"stop": float(stop), "preempt": float(preempt)}, "max")
            stop, preempt = bool(flags["stop"]), bool(flags["preempt"])
        if preempt and self.current_epoch < self.config.max_iter:
            self._stop_for_preemption(local_preempt or "another rank was asked to stop")
            return
        if stop and not self.stop_training:
            self.stop_reason = self.stop_reason or "trainstop_criterion returned True"
        self.stop_training = stop
        if stop:
            self.console_print(f"Stopping after epoch {self.current_epoch}: {self.stop_reason or 'requested'}.")

    def _validate(self) -> None:
        self.callbacks.fire("val_epoch_start", self)
        self.metrics.update(self._evaluate("val", self._val_loader))
        self._set_result(self.current_epoch)
        self.callbacks.fire("val_epoch_end", self)

    def _evaluate(self, phase: str, loader: Any) -> dict[str, float]:
        """Sample-weighted mean of loss and metrics over all ranks (the unwrapped model: no DDP sync)."""
        model = self.model
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = 0.0
        start, end = f"{phase}_batch_start", f"{phase}_batch_end"
        with torch.no_grad():
            for i, batch in enumerate(self._batches(loader), 1):  # batch events count this pass's batches
                batch = self.accelerator.prepare_batch(batch)
                self._set_result(i)
                self.callbacks.fire(start, self)
                loss, metrics = call_loss(self.loss_fn, model, batch)
                size = float(_batch_size(batch))
                count += size
                for k, v in {"loss": loss, **metrics}.items():
                    totals[k] = totals.get(k, 0.0) + v.detach().float() * size
                self._set_result(i, loss, metrics)
                self.callbacks.fire(end, self)
        model.train(was_training)
        reduced = collectives.all_reduce_dict({**totals, "__count": count}, "sum")
        denom = max(float(reduced.pop("__count")), 1.0)
        return {f"{phase}_{k}": float(v) / denom for k, v in reduced.items()}

    # ------------------------------------------------------------------ steps

    # ------------------------------------------------------------------ set-up and teardown
    def _setup_runtime(self, for_training: bool) -> None:
        acc, cfg = self.accelerator, self.config
        acc.setup()
        if cfg.seed is not None:
            seed_everything(cfg.seed + acc.rank)
        self.callbacks = CallbackManager(list(cfg.callbacks), acc.is_main_process)  # test_* events for test()
        if not for_training:  # evaluation uses the plain module: no DDP needed
            self.model = acc.prepare_model(self.model) if acc.world_size == 1 else self.model.to(acc.device)
            return
        moved: dict[int, nn.Parameter] = {}
        self._model = acc.prepare_model(self.model, moved)
        if self.use_grad:
            acc._retarget_optimizer(self.optimizer, moved)
        seed = cfg.seed if cfg.seed is not None else 0
        self._train_loader = _prepare_train(self.train_dataloader, acc, seed)
        self._val_loader = prepare_eval_dataloader(self.val_dataloader, acc.rank, acc.world_size) \
            if self.val_dataloader is not None else None
        self._choose_step()
        self._device, self._data_dtype = acc.device, acc.data_dtype
        self._resume_batch, self._resume_partial, self._partial, self._pending_rng = 0, None, None, None
        self._saved_at = -1
        self._stopper = GracefulStop(resolve_signals(cfg.stop_signals),
                                     cfg.stop_file or os.environ.get("TRAINSTACK_STOP_FILE"))
        self._stopper.install()
        self.run_folder = Path(acc.broadcast(str(self._pick_folder()) if acc.is_main_process else None))
        self.config.log_folder = self.run_folder
        self.checkpointer = Checkpointer(self.run_folder, cfg.keep_last_checkpoints)
        user = list(cfg.callbacks) + ([LRScheduler(self.scheduler)] if self.scheduler is not None else [])
        cbs = user + default_callbacks(cfg)
        if acc.is_main_process and progress_enabled(cfg.verbose):
            cbs += ProgressBar(cfg.max_iter, self.current_epoch, self._batches_per_epoch()).callbacks()
        self.callbacks = CallbackManager(cbs, acc.is_main_process)
        if acc.is_main_process:
            self.writer = make_writers(cfg.tracking_tool, self.run_folder, self.current_epoch)
        if cfg.resume is not None:  # load before the banner so it shows where training continues
            self.load_checkpoint(None if cfg.resume == "auto" else cfg.resume)
        if acc.is_main_process and cfg.verbose:
            print(banner(self._banner_info()), flush=True)

    def _pick_folder(self) -> Path:
        cfg = self.config
        if self.run_folder is not None:  # a second fit() continues in the same folder
            return self.run_folder
        return choose_run_folder(cfg.root_folder, cfg.log_folder, cfg.create_subfolder_per_run, cfg.resume)

    def _batches_per_epoch(self) -> int | None:
        loader = self._train_loader
        if loader is None:
            return 1
        try:
            n = len(loader)
        except TypeError:
            return self.max_batches
        return min(n, self.max_batches) if self.max_batches else n

    def _batches(self, loader: Any, cap: int | None = None) -> Iterable[Any]:
        if loader is None:
            return (None,)  # no data: loss_fn(model, None) once per epoch (reference behaviour)
        return itertools.islice(loader, cap) if cap else loader

    def _epoch_metrics(self, phase: str, loss_sum: Any, sums: dict[str, Any], n: int) -> dict[str, Any]:
        if n == 0:
            return {}
        out = {f"{phase}_loss": loss_sum / n, **{f"{phase}_{k}": v / n for k, v in sums.items()}}
        if self.config.all_reduce_metrics:
            out = self.accelerator.all_reduce_dict(out)
        return out

    def _set_result(self, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        res = self.opt_result
        res.iteration, res.model, res.optimizer = iteration, self.model, self.optimizer
        res.loss = self.metrics.get("train_loss") if loss is None else loss
        res.metrics = self.metrics if metrics is None else metrics
        res.rank, res.device = self.accelerator.rank, self.accelerator.device

    def _close(self) -> None:
        if getattr(self, "_stopper", None) is not None:
            self._stopper.restore()
        if self.accelerator.is_main_process and self.run_folder is not None:
            if self.writer.history:
                save_loss_curve(self.writer.history, self.run_folder / "loss_curve.png")
            self.writer.close()
        self.writer = NullWriter()

    def _banner_info(self) -> dict[str, Any]:
        acc, cfg, loader = self.accelerator, self.config, self.train_dataloader
        per_proc = getattr(loader, "batch_size", None) or 1
        per_epoch = self._batches_per_epoch()
        info = {"Num examples": _num_examples(loader), "Num epochs": cfg.max_iter,
                "Processes": f"{acc.world_size} ({acc.backend} on {acc.device.type})",
                "Batch size per process": per_proc,
                "Total batch size (w. parallel & accumulation)": per_proc * acc.world_size
                * cfg.gradient_accumulation_steps,
                "Gradient accumulation steps": cfg.gradient_accumulation_steps,
                "Total optimization steps": "unknown" if per_epoch is None else
                math.ceil(per_epoch / cfg.gradient_accumulation_steps) * cfg.max_iter,
                "Run folder": self.run_folder}
        if self.current_epoch:
            info["Resumed at epoch"] = self.current_epoch
        return info

    # ------------------------------------------------------------------ checkpoints

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_model", "_train_loader", "_val_loader", "callbacks", "writer", "checkpointer", "_step",
                    "_stopper", "_device"):
            state.pop(key, None)
        state["writer"] = NullWriter()
        return state


def _prepare_train(loader: Any, acc: Accelerator, seed: int) -> Any:
    if isinstance(loader, DataLoader):
        return prepare_dataloader(loader, acc.rank, acc.world_size, seed=seed, pin_memory=acc.pin_memory)
    return loader


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 1


def _num_examples(loader: Any) -> Any:
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return "unknown"



"""`Trainer`: the training loop. Correct under any number of processes, resumable exactly.

Example::

    from trainstack import Trainer, TrainConfig

    config = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=50, print_every=5)
    model, optimizer = Trainer(model, optimizer, config, loss_fn="mse").fit(dataloader)

The loop (:meth:`Trainer._fit`, :meth:`Trainer._train_epoch`, :meth:`Trainer._end_epoch`) reads top to bottom and
calls its collaborators by name, each in the training room (:mod:`trainstack._train`) or below it: ``self.step``
turns a batch into an optimizer step, ``self.cursor`` knows where a resumed epoch stands, ``self.checkpointer``
saves and restores, ``self.stopper`` makes the ranks agree on stopping, ``self.evaluate`` validates and tests,
``self.tracker`` prints, writes and plots (rank 0), and ``self.callbacks`` are the user's.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from . import _envvars as envvars
from ._runtime import watchdog
from ._runtime.preemption import GracefulStop, resolve_signals
from ._runtime.watchdog import heartbeat
from ._train import handoff, qadence
from ._train.evaluate import Evaluator, prepare_eval
from ._train.handoff import DIVERGED, PREEMPTED
from ._train.metrics import EpochSums, nonfinite_loss
from ._train.notes import UNBOUNDED_LOADER, diverged_reason, first_step_note, resume_notes
from ._train.qadence import UseGrad, check_optimizer, refuse_qadence_hooks
from ._train.resume import EpochCursor, derived_seed
from ._train.runfolder import RunFolder, run_identity, standalone_checkpointer
from ._train.steps import Step, check_step_options, get_loss_fn, make_step, optimize_step
from ._train.tracker import Tracker, banner_info
from .accelerator import Accelerator, seed_everything
from .callbacks import CallbackManager, LRScheduler, OptimizeResult
from .checkpoint import Checkpointer, Restored, restore_rng
from .config import TrainConfig
from .data import batches_per_epoch, check_loader, is_infinite, prepare_train
from .errors import ConfigError

__all__ = ["Trainer"]

log = logging.getLogger(__name__)
_UNBOUNDED_REPORT = 1000  # batches between "still in epoch N" lines for a loader without a length


def _accelerator_for(config: TrainConfig, model: nn.Module) -> Accelerator:
    """The runtime a TrainConfig asks for (the Trainer runs its own hang watchdog, with heartbeats from its loop);
    FSDP blocks the model does not have are an error here, before any process starts."""
    if config.strategy == "fsdp" and config.fsdp_blocks:
        from ._runtime.fsdp import check_blocks

        check_blocks(model, config.fsdp_blocks)
    return Accelerator(
        nprocs=config.nprocs, compute_setup=config.compute_setup, log_setup=config.log_setup, dtype=config.dtype,
        backend=config.backend, strategy=config.strategy, fsdp_blocks=config.fsdp_blocks,
        fsdp_min_params=config.fsdp_min_params, hang_timeout=0,
        fsdp_param_dtype=torch.bfloat16 if config.strategy == "fsdp" and config.mixed_precision == "bf16" else None)


def _fit_entry(trainer: Trainer) -> dict[str, Any] | None:
    """Runs in every process (module-level so it pickles)."""
    return trainer._fit()


def _test_entry(trainer: Trainer, loader: Any) -> dict[str, float]:
    acc = trainer.accelerator
    acc.setup()
    if trainer.config.seed is not None:
        seed_everything(trainer.config.seed + acc.rank)
    trainer.callbacks = CallbackManager(list(trainer.config.callbacks), acc.is_main_process)  # test_* events
    return Evaluator(acc, trainer.loss_fn, trainer._fire_batch).test(trainer.model, loader)


class Trainer:
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` processes.

    ``loss_fn`` is ``"mse"``, ``"cross_entropy"`` or ``(model, batch) -> loss | (loss, metrics)``; metrics are
    reported with ``train_``/``val_``/``test_`` prefixes. ``optimize_step`` defaults to a closure-based step
    (LBFGS works). ``scheduler`` is any ``torch.optim.lr_scheduler``, stepped after every epoch.
    """

    _use_grad: ClassVar[bool] = True
    # What one run holds on each rank (set by _start_run, dropped when the Trainer is pickled to workers):
    step: Step
    checkpointer: Checkpointer
    stopper: GracefulStop
    evaluate: Evaluator
    _ddp_model: nn.Module
    _train_loader: Any
    _val_loader: Any
    _per_epoch: int | None  # batches per epoch (None: until the loader ends); _capped: stop after them anyway
    _capped: bool
    _last_epoch: int
    _first_step: int  # the global step this run started at (a failure there gets a note on the loss contract)
    _folder: RunFolder | None

    def __init__(self, model: nn.Module, optimizer: Any, config: TrainConfig, loss_fn: Any = "mse",
                 train_dataloader: Any = None, val_dataloader: Any = None, test_dataloader: Any = None,
                 optimize_step: Any = optimize_step, max_batches: int | None = None, scheduler: Any = None) -> None:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a trainstack TrainConfig, got {type(config).__name__}.")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.model, self.optimizer, self.config = model, optimizer, config
        refuse_qadence_hooks(type(self), Trainer)
        check_optimizer(optimizer, self.use_grad)
        self.loss_fn = get_loss_fn(loss_fn)
        self.optimize_step = optimize_step
        self.train_dataloader = check_loader(train_dataloader, "training")
        self.val_dataloader = check_loader(val_dataloader, "validation")
        self.test_dataloader = check_loader(test_dataloader, "test")
        self.max_batches = max_batches if max_batches is not None else config.max_batches
        self.scheduler = LRScheduler(scheduler) if scheduler is not None else None
        self.accelerator = _accelerator_for(config, model)
        check_step_options(config, optimizer, self._custom_step, self.use_grad, self.accelerator.use_cuda)
        self.current_epoch = self.global_step = 0
        self.run_folder: Path | None = None
        self.stop_training, self.stop_reason = False, ""
        self.metrics: dict[str, Any] = {}
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.callbacks = CallbackManager(list(config.callbacks), True)
        self.tracker = Tracker(config, None, is_main=False)
        self.cursor = EpochCursor()
        self._claimed: Path | None = None  # set by fit() while the launching process holds the run folder
        self._continues = False  # set by fit(): this fit() continues the run of an earlier one
        self._run_identity: dict[str, Any] | None = None  # this experiment's, as its checkpoints record it
        self._run_start, self._best_val = 0, math.inf

    # ------------------------------------------------------------------ gradient mode (qadence switches)
    use_grad = UseGrad()  # this Trainer's mode; set_use_grad sets every Trainer's
    set_use_grad = classmethod(qadence.set_use_grad)
    enable_grad_opt = qadence.enable_grad_opt
    disable_grad_opt = qadence.disable_grad_opt

    @property
    def _custom_step(self) -> bool:
        return self.optimize_step not in (optimize_step, sys.modules.get("trainstack.optimize_step"))

    # ------------------------------------------------------------------ public API
    def fit(self, train_dataloader: Any = None, val_dataloader: Any = None) -> tuple[nn.Module, Any]:
        """Train for ``config.max_iter`` epochs; returns ``(model, optimizer)`` holding rank 0's final state.

        A second ``fit()`` on the same Trainer continues the run for another ``max_iter`` epochs.
        """
        if train_dataloader is not None:
            self.train_dataloader = check_loader(train_dataloader, "training")
        if val_dataloader is not None:
            self.val_dataloader = check_loader(val_dataloader, "validation")
        if self.config.val_every and self.val_dataloader is None:
            raise ConfigError(f"TrainConfig.val_every={self.config.val_every} but no validation DataLoader was "
                              f"given. HINT: fit(train_loader, val_loader) or Trainer(..., val_dataloader=...).")
        self.stop_training, self.stop_reason = False, ""
        # a second fit() on this Trainer continues its run folder (unless a new folder per run is asked for)
        self._continues = self.run_folder is not None and not self.config.create_subfolder_per_run
        plan = self.accelerator.plan
        folder = RunFolder(self.config, self._run_identity or run_identity(self.config, self.optimizer),
                           self.console_print)
        try:
            if plan.spawn and plan.rank_offset == 0:  # this process launches rank 0: it claims the run folder, so a
                self._claimed = folder.claim(self.run_folder if self._continues else None)  # busy one errs here
                self.run_folder = self._claimed
                folder.fits(self.model, self._claimed)
            held = [folder.lock.fileno()] if folder.lock is not None else []  # spawned workers keep it locked too
            result = self.accelerator.distribute(_fit_entry, keep_open=held)(self)
        finally:
            self._claimed = None
            folder.release()
        if plan.spawn and result is not None:
            handoff.absorb(self, result, CallbackManager(self._user_callbacks(), True))
        handoff.conclude(self)  # a stopped run raises: Preempted (requeue me) or TrainingDiverged
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """Evaluate on the given (or constructor) loader, reduced over all ranks without padding duplicates."""
        loader = check_loader(test_dataloader, "test") if test_dataloader is not None else self.test_dataloader
        if loader is None:
            raise ConfigError("test() needs a DataLoader: test(loader) or Trainer(..., test_dataloader=loader).")
        return self.accelerator.distribute(_test_entry)(self, loader)

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's module (the DDP wrapper used for training is internal)."""
        return self.model

    @property
    def writer(self) -> Any:
        """Where callbacks write metrics (rank 0; a no-op elsewhere)."""
        return self.tracker.writer

    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop after the current epoch (agreed by an all-reduce)."""
        self.stop_training, self.stop_reason = True, reason

    def console_print(self, text: str) -> None:
        """Print from rank 0 only."""
        if self.accelerator.is_main_process:
            print(text, flush=True)

    def save_checkpoint(self, best: bool = False) -> Path | None:
        """Collective: rank 0 writes ``ckpt-e<epoch>-s<step>.pt`` (or ``best.pt``); also outside ``fit()``."""
        self._outside_fit_checkpointer()
        with watchdog.phase("checkpoint"):  # the hang watchdog allows saves more time
            return self.checkpointer.save(self._counters(), self._parts(), self.config.to_dict(), best=best)

    def load_checkpoint(self, path: Any = None) -> bool:
        """Load on **every** rank (``None``: the latest readable checkpoint of the run folder)."""
        outside = self._outside_fit_checkpointer()
        restored = self.checkpointer.restore(self._parts(), path, rank=self.accelerator.rank)
        if restored is None:
            return False
        if outside:  # no loop to position: the model, optimizer and counters
            self.current_epoch, self.global_step = int(restored.counters["epoch"]), int(
                restored.counters["global_step"])
        else:
            self._apply(restored)
        return True

    # ------------------------------------------------------------------ the loop (every rank)
    def _fit(self) -> dict[str, Any] | None:
        try:
            self._start_run()
            self.callbacks.fire("train_start", self)
            while self.current_epoch < self._last_epoch and not self.stop_training:
                if not self.cursor.batch:
                    self.callbacks.fire("train_epoch_start", self)
                if self._train_epoch():  # stopped mid-epoch: checkpoint written, epoch not finished
                    break
                self.current_epoch += 1
                if self.config.val_every and self.current_epoch % self.config.val_every == 0:
                    self._validate()
                self._end_epoch()
            if not self.stop_reason.startswith((PREEMPTED, DIVERGED)):  # only a finished run has an end
                self._finish()
            with watchdog.phase("checkpoint"):
                self.checkpointer.wait()  # an asynchronous save in flight is committed before the run ends
        finally:
            self._close()
        return handoff.export(self)

    def _train_epoch(self) -> bool:
        """One pass over the training data (the rest of one after a mid-epoch resume); True when stopped early."""
        model, step, tracker, hb = self._ddp_model, self.step, self.tracker, heartbeat()
        pending_rng = self.cursor.pending_rng
        n, totals, batches, left = self.cursor.begin(self._train_loader, self._per_epoch, self._capped)
        sums = EpochSums(totals)
        if pending_rng is not None:  # restored only now: creating the iterator drew from the global RNG
            restore_rng(pending_rng)
            self.cursor.pending_rng = None
        step.begin_epoch(left)
        model.train()
        on_start, on_end = self.callbacks.period("train_batch_start"), self.callbacks.period("train_batch_end")
        poll, bar, prepare = self.config.stop_check_every, tracker.bar_every, self.accelerator.prepare_batch
        report = _UNBOUNDED_REPORT if self._per_epoch is None else 0
        batch = None
        hb.phase = "data"
        try:
            for batch in batches:
                batch = prepare(batch)
                if on_start and (self.global_step + 1) % on_start == 0:
                    self._fire_batch("train_batch_start", self.global_step + 1)
                loss, metrics = step(model, batch)
                n += 1
                self.global_step += 1
                hb.step = self.global_step
                hb.beats += 1
                sums.add(loss, metrics)
                if on_end and self.global_step % on_end == 0:
                    self._fire_batch("train_batch_end", self.global_step, loss, metrics)
                if bar and self.global_step % bar == 0:
                    tracker.batch_end()
                if report and n % report == 0:
                    tracker.print(f"epoch {self.current_epoch + 1}: {n} batches so far (the training loader has no "
                                  f"length, so an epoch ends when it is exhausted; max_batches bounds it)")
                if self.global_step % poll == 0 and step.at_boundary and self._stop_now(n, sums):
                    return True
                hb.phase = "data"
        except Exception as exc:
            if self.global_step == self._first_step and hasattr(exc, "add_note"):
                exc.add_note(first_step_note(batch))
            raise
        self.metrics = sums.means("train", n, self.accelerator.all_reduce_dict if self.config.all_reduce_metrics
                                  else None)
        self.cursor.end_epoch()
        return False

    def _end_epoch(self) -> None:
        """Callbacks and reports, then the ranks agree (one small collective) on stopping, then the checkpoint."""
        cfg, epoch = self.config, self.current_epoch
        self._set_result(epoch)
        self.callbacks.fire("train_epoch_end", self)
        with watchdog.phase("callback"):  # plots and tracker writes may take a while on rank 0
            self.tracker.epoch_end(epoch, self.metrics, self.model)
        wants_stop = self.stop_training or bool(cfg.trainstop_criterion and cfg.trainstop_criterion(self))
        agreed, preempt = self.stopper.agree(self.accelerator.world_size, stop=wants_stop,
                                             nonfinite=cfg.stop_on_nonfinite and nonfinite_loss(self.metrics))
        if agreed["nonfinite"]:  # before saving: the last finite checkpoint must survive rotation
            self._stop_diverged()
            return
        if cfg.checkpoint_every and not cfg.checkpoint_best_only and epoch % cfg.checkpoint_every == 0:
            self.save_checkpoint()
        if preempt and epoch < self._last_epoch:
            self._stop_for_preemption(preempt)
        elif agreed["stop"]:
            self.stop_training = True
            self.stop_reason = self.stop_reason or "trainstop_criterion returned True"
            self.tracker.print(f"Stopping after epoch {epoch}: {self.stop_reason}.")

    def _validate(self) -> None:
        self.callbacks.fire("val_epoch_start", self)
        self.metrics.update(self.evaluate("val", self.model, self._val_loader))
        self._set_result(self.current_epoch)
        self.callbacks.fire("val_epoch_end", self)
        if self.config.checkpoint_best_only and self._improved(self.metrics.get("val_loss", math.nan)):
            self.save_checkpoint(best=True)

    def _finish(self) -> None:
        """The end of a finished run: the final checkpoint, the user's train_end callbacks, the last reports."""
        if not self.config.checkpoint_best_only:
            self.save_checkpoint()
        self._set_result(self.current_epoch)
        self.callbacks.fire("train_end", self)
        with watchdog.phase("callback"):
            self.tracker.train_end(self.current_epoch, self.model)

    # ------------------------------------------------------------------ stopping
    def _stop_now(self, n: int, sums: EpochSums) -> bool:
        """Every rank asks at the same step; if any rank was asked to stop, all save and stop together."""
        _, why = self.stopper.agree(self.accelerator.world_size)
        if why is None:
            return False
        self.cursor.stop_at(n, getattr(self._train_loader, "samples_per_step", None), self.accelerator.world_size,
                            sums.loss_sum, sums.sums)
        self._stop_for_preemption(why)
        return True

    def _stop_for_preemption(self, why: str) -> None:
        self.stop_training, self.stop_reason = True, f"{PREEMPTED} ({why})"
        path = self.save_checkpoint()
        with watchdog.phase("checkpoint"):
            path = self.checkpointer.wait() or path  # an asynchronous save must be complete before the job ends
        took = self.checkpointer.last_save_seconds
        if self.accelerator.is_main_process:  # tells the batch script: checkpoint complete, requeue me
            self.stopper.confirm_saved(path or self.checkpointer.latest())
        self.tracker.print(f"Graceful stop at epoch {self.current_epoch}, step {self.global_step}: {why}. "
                           f"Checkpoint {path.name if path else '(already saved)'}"
                           f"{f' written in {took:.2f}s' if took and path else ''}.")

    def _stop_diverged(self) -> None:
        reason = diverged_reason(self.metrics.get("train_loss"), self.current_epoch, self.checkpointer.latest())
        self.stop_training, self.stop_reason = True, f"{DIVERGED}: {reason}"
        self.tracker.print(f"trainstack: {reason}")

    def _improved(self, val_loss: float) -> bool:
        criterion = self.config.validation_criterion or (lambda cur, best, eps: cur < best - eps)
        if math.isfinite(val_loss) and criterion(val_loss, self._best_val, self.config.val_epsilon):
            self._best_val = val_loss
            return True
        return False

    # ------------------------------------------------------------------ set-up and teardown
    def _start_run(self) -> None:
        """Everything one run needs on this rank: device, data shards, step, run folder, checkpoint, reports."""
        acc, cfg = self.accelerator, self.config
        acc.setup()
        if cfg.seed is not None:
            seed_everything(cfg.seed + acc.rank)
        moved: dict[int, nn.Parameter] = {}
        self._ddp_model = acc.prepare_model(self.model, moved)
        if self.use_grad:
            acc._retarget_optimizer(self.optimizer, moved)
        self._train_loader = prepare_train(self.train_dataloader, acc.rank, acc.world_size, cfg.seed or 0,
                                           acc.pin_memory)
        self._val_loader = prepare_eval(self.val_dataloader, acc.rank, acc.world_size)
        self._per_epoch = batches_per_epoch(self._train_loader, self.max_batches)
        self._capped = bool(self.max_batches) or is_infinite(self._train_loader)
        self.step = make_step(cfg, self.optimizer, self.loss_fn, self.optimize_step, self.use_grad, acc.device,
                              acc.data_dtype)
        self.evaluate = Evaluator(acc, self.loss_fn, self._fire_batch)
        self.stopper = GracefulStop(resolve_signals(cfg.stop_signals),
                                    cfg.stop_file or os.environ.get(envvars.STOP_FILE))
        self.stopper.install()
        self._run_identity = self._run_identity or run_identity(cfg, self.optimizer)  # before any lr change
        self._folder = RunFolder(cfg, self._run_identity, self.console_print)
        self.run_folder = self._folder.agree(acc, self._claimed, self.run_folder if self._continues else None)
        sharded = cfg.checkpoint_format == "sharded" or cfg.checkpoint_format == "auto" and cfg.strategy == "fsdp"
        self.checkpointer = Checkpointer(self.run_folder, cfg.keep_last_checkpoints, acc.is_main_process, sharded,
                                         cfg.async_checkpoint)
        watchdog.start(acc.rank, acc.world_size, watchdog.resolve_timeout(cfg.hang_timeout), self.run_folder,
                       watchdog.default_store(), armed=True)
        self.callbacks = CallbackManager(self._user_callbacks(), acc.is_main_process)
        restored = self._resume()
        self.tracker = Tracker(cfg, self.run_folder, acc.is_main_process, self.current_epoch, self._last_epoch,
                               self._per_epoch, clock=lambda: self.global_step,
                               keep_through=int(restored.counters["global_step"]) if restored else None)
        self.tracker.start(banner_info(self, self._per_epoch, self._last_epoch,
                                       watchdog.resolve_timeout(cfg.hang_timeout)))

    def _resume(self) -> Restored | None:
        """Continue from a checkpoint when asked (before the banner, so it shows where training continues), and
        say what this run is: new, continued, or with nothing left to train."""
        cfg = self.config
        self.cursor, self._best_val, self._run_start, restored = EpochCursor(), math.inf, self.current_epoch, None
        if cfg.resume is not None:
            restored = self.checkpointer.restore(self._parts(), None if cfg.resume == "auto" else cfg.resume,
                                                 rank=self.accelerator.rank)
            if restored is not None:
                self._apply(restored)
        self._last_epoch = self._run_start + cfg.max_iter
        self._first_step = self.global_step
        for note in resume_notes(cfg, self.run_folder, restored is not None, self._continues, self.current_epoch,
                                 self._last_epoch) + ([UNBOUNDED_LOADER] if self._per_epoch is None else []):
            self.console_print(note)
        return restored

    def _close(self) -> None:
        """Release what the run holds; never raises over the error that ended the run."""
        watchdog.stop()
        if getattr(self, "stopper", None) is not None:
            self.stopper.restore()
        self.tracker.close()
        folder = getattr(self, "_folder", None)
        if folder is not None:
            folder.release()

    def _outside_fit_checkpointer(self) -> bool:
        """A checkpointer for a Trainer used outside ``fit()`` (see ``standalone_checkpointer``); True outside."""
        if getattr(self, "checkpointer", None) is not None and getattr(self, "_train_loader", None) is not None:
            return False
        self.run_folder, self.checkpointer = standalone_checkpointer(self.config, self.run_folder)
        return True

    # ------------------------------------------------------------------ state
    def _counters(self) -> dict[str, Any]:
        """The loop's own state in a checkpoint; the parts (model, optimizer, ...) save themselves."""
        return {"epoch": self.current_epoch, "global_step": self.global_step, "run_start_epoch": self._run_start,
                "partial_epoch": self.cursor.checkpoint(), "best_val_loss": self._best_val,
                "saved_at": time.time(), "identity": self._run_identity}

    def _user_callbacks(self) -> list[Any]:
        return list(self.config.callbacks) + ([self.scheduler] if self.scheduler else [])

    def _parts(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer if self.use_grad else None,
                "scheduler": self.scheduler, "scaler": getattr(self, "step", None), "callbacks": self.callbacks}

    def _apply(self, restored: Restored) -> None:
        """Take over a checkpoint's counters; a mid-epoch one continues at its batch with its partial sums."""
        c, acc = restored.counters, self.accelerator
        self.current_epoch, self.global_step = int(c["epoch"]), int(c["global_step"])
        self._run_start, self._best_val = int(c.get("run_start_epoch", 0)), float(c.get("best_val_loss", math.inf))
        self._run_identity = c.get("identity") or self._run_identity
        if hasattr(self._train_loader, "set_epoch"):
            self._train_loader.set_epoch(self.current_epoch)
        where = self.cursor.resume(restored, acc.world_size, getattr(self._train_loader, "samples_per_step", None),
                                   derived_seed(self.config.seed or 0, acc.rank, self.global_step))
        self.console_print(f"Resumed from {restored.path} (epoch {self.current_epoch}, step {self.global_step}"
                           f"{where}).")

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker receives: configuration and state, not this process's run handles."""
        return handoff.worker_state(self, Tracker(self.config, None, is_main=False))

    # ------------------------------------------------------------------ helpers
    def _fire_batch(self, event: str, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        self._set_result(iteration, loss, metrics)
        self.callbacks.fire(event, self)

    def _set_result(self, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        res = self.opt_result
        res.iteration, res.model, res.optimizer = iteration, self.model, self.optimizer
        res.loss = self.metrics.get("train_loss") if loss is None else loss
        res.metrics = self.metrics if metrics is None else metrics
        res.rank, res.device = self.accelerator.rank, self.accelerator.device

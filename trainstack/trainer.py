"""`Trainer`: the training loop. Correct under any number of processes, resumable exactly.

Example::

    from trainstack import Trainer, TrainConfig

    config = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=50, print_every=5)
    model, optimizer = Trainer(model, optimizer, config, loss_fn="mse").fit(dataloader)

The loop (:meth:`Trainer._fit`, :meth:`Trainer._train_epoch`, :meth:`Trainer._end_epoch`) reads top to bottom and
calls its collaborators by name: ``self.step`` turns a batch into an optimizer step (:mod:`.steps`),
``self.checkpointer`` saves and restores (:mod:`.checkpoint`), ``self.stopper`` makes the ranks agree on stopping
(:mod:`.preemption`), ``self.tracker`` prints, writes and plots (rank 0), and ``self.callbacks`` are the user's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import _collectives as collectives
from . import _watchdog as watchdog
from ._runfolder import RunFolderBusy, RunLock, auto_chosen, choose_run_folder, refuse_to_overwrite
from ._tracker import Tracker
from ._watchdog import heartbeat
from .accelerator import Accelerator, seed_everything
from .callbacks import CallbackManager, LRScheduler, OptimizeResult
from .checkpoint import CheckpointError, Checkpointer, Restored, restore_rng
from .config import TrainConfig
from .data import (
    DictDataLoader,
    batches_per_epoch,
    check_loader,
    epoch_batches,
    is_infinite,
    prepare_dataloader,
    prepare_eval_dataloader,
)
from .errors import ConfigError, Preempted, TrainingDiverged
from .preemption import GracefulStop, resolve_signals
from .steps import Step, call_loss, check_step_options, get_loss_fn, make_step, optimize_step

__all__ = ["Trainer"]

log = logging.getLogger(__name__)
PREEMPTED, DIVERGED = "preempted", "diverged"
_UNBOUNDED_REPORT = 1000  # batches between "still in epoch N" lines for a loader without a length


def _fit_entry(trainer: Trainer) -> dict[str, Any] | None:
    """Runs in every process (module-level so it pickles)."""
    return trainer._fit()


def _test_entry(trainer: Trainer, loader: Any) -> dict[str, float]:
    return trainer._test(loader)


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
    _ddp_model: nn.Module
    _train_loader: Any
    _val_loader: Any
    _per_epoch: int | None  # batches per epoch (None: until the loader ends)
    _capped: bool  # an epoch stops after _per_epoch batches even if the loader has more
    _last_epoch: int
    _run_start: int  # the epoch at which this run (first fit, or the one a checkpoint continues) began
    _resume_at: int  # a resumed epoch starts at this batch ...
    _resume_totals: dict[str, Any]  # ... with these partial sums ...
    _pending_rng: dict[str, Any] | None  # ... and these RNG states, restored once its iterator exists
    _partial: dict[str, Any] | None  # the position saved by a mid-epoch stop
    _resume_samples: Any  # global samples of the stopped epoch to jump over (int, or per key for a dict loader)
    _epoch_base: Any  # global samples consumed before this segment of the epoch (same shapes)
    _best_val: float
    _first_step: int  # the global step this run started at (a failure there gets a note on the loss contract)
    _lock: RunLock | None

    def __init__(self, model: nn.Module, optimizer: Any, config: TrainConfig, loss_fn: Any = "mse",
                 train_dataloader: Any = None, val_dataloader: Any = None, test_dataloader: Any = None,
                 optimize_step: Any = optimize_step, max_batches: int | None = None, scheduler: Any = None) -> None:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a trainstack TrainConfig, got {type(config).__name__}.")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        self.model, self.optimizer, self.config = model, optimizer, config
        _refuse_qadence_hooks(type(self))
        self._check_optimizer()
        self.loss_fn = get_loss_fn(loss_fn)
        self.optimize_step = optimize_step
        self.train_dataloader = check_loader(train_dataloader, "training")
        self.val_dataloader = check_loader(val_dataloader, "validation")
        self.test_dataloader = check_loader(test_dataloader, "test")
        self.max_batches = max_batches if max_batches is not None else config.max_batches
        self.scheduler = LRScheduler(scheduler) if scheduler is not None else None
        self.accelerator = Accelerator(
            nprocs=config.nprocs, compute_setup=config.compute_setup, log_setup=config.log_setup, dtype=config.dtype,
            backend=config.backend, strategy=config.strategy, fsdp_blocks=config.fsdp_blocks,
            fsdp_min_params=config.fsdp_min_params, hang_timeout=0,  # the Trainer runs its own watchdog
            fsdp_param_dtype=torch.bfloat16 if config.strategy == "fsdp" and config.mixed_precision == "bf16" else None)
        check_step_options(config, optimizer, self._custom_step, self.use_grad, self.accelerator.use_cuda)
        if config.strategy == "fsdp" and config.fsdp_blocks:
            from ._fsdp import check_blocks

            check_blocks(model, config.fsdp_blocks)  # here, before any process starts
        self.current_epoch = self.global_step = 0
        self.run_folder: Path | None = None
        self.stop_training, self.stop_reason = False, ""
        self.metrics: dict[str, Any] = {}
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.callbacks = CallbackManager(list(config.callbacks), True)
        self.tracker = Tracker(config, None, is_main=False)
        self._claimed = False  # set by fit() while the launching process holds the run folder's lock
        self._continues = False  # set by fit(): this fit() continues the run of an earlier one
        self._run_identity: dict[str, Any] | None = None  # this experiment's, as its checkpoints record it
        self._run_start, self._partial, self._best_val = 0, None, math.inf

    # ------------------------------------------------------------------ gradient mode (qadence switches)
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
        """Class-wide switch: False trains with a gradient-free nevergrad optimizer (as qadence)."""
        if not isinstance(value, bool):
            raise ConfigError(f"Trainer.set_use_grad expects True or False, got {value!r}.")
        cls._use_grad = value

    @contextlib.contextmanager
    def enable_grad_opt(self, optimizer: Any = None) -> Iterator[Trainer]:
        """``with trainer.enable_grad_opt(): trainer.fit(...)`` trains with gradients (optionally ``optimizer``);
        the previous mode and optimizer come back afterwards (qadence)."""
        with self._grad_mode(True, optimizer):
            yield self

    @contextlib.contextmanager
    def disable_grad_opt(self, ng_optimizer: Any = None) -> Iterator[Trainer]:
        """``with trainer.disable_grad_opt(ng_optimizer): trainer.fit(...)`` trains gradient-free (nevergrad)."""
        with self._grad_mode(False, ng_optimizer):
            yield self

    @contextlib.contextmanager
    def _grad_mode(self, use_grad: bool, optimizer: Any) -> Iterator[None]:
        saved = (self.__dict__.get("_use_grad_instance"), self.optimizer)
        self.use_grad = use_grad
        if optimizer is not None:
            self.optimizer = optimizer
        try:
            self._check_optimizer()
            check_step_options(self.config, self.optimizer, self._custom_step, use_grad, self.accelerator.use_cuda)
            yield
        finally:
            if saved[0] is None:
                self.__dict__.pop("_use_grad_instance", None)
            else:
                self.__dict__["_use_grad_instance"] = saved[0]
            self.optimizer = saved[1]

    def _check_optimizer(self) -> None:
        opt = self.optimizer
        if self.use_grad and not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer (use_grad=True), got {type(opt).__name__}.")
        if not self.use_grad and not (hasattr(opt, "ask") and hasattr(opt, "tell")):
            raise ConfigError(f"gradient-free training (use_grad=False) needs a nevergrad optimizer, e.g. "
                              f"ng.optimizers.NGOpt(parametrization=n_params, budget=max_iter), got "
                              f"{type(opt).__name__}.")

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
        lock = None
        if plan.spawn and plan.rank_offset == 0:  # this process launches rank 0: it claims the run folder, so a
            self.run_folder, lock = self._claim_folder()  # busy or reused folder is a plain error here
            try:
                self._check_resume_fits()
            except BaseException:
                lock.release()
                raise
        self._claimed = lock is not None
        try:
            held = [lock.fileno()] if lock is not None else []  # spawned workers keep the folder locked too
            result = self.accelerator.distribute(_fit_entry, keep_open=held)(self)
        finally:
            self._claimed = False
            if lock is not None:
                lock.release()
        if plan.spawn and result is not None:
            self._absorb(result)
        runs = self.config.__dict__.setdefault("_runs", [])  # not a field: what this config trained, for the note
        if self.run_folder is not None and self.run_folder not in runs:
            runs.append(self.run_folder)
        if self.stop_reason.startswith(PREEMPTED):
            raise Preempted(f"trainstack: {self.stop_reason}; a complete checkpoint is in {self.run_folder}. "
                            f"Run again with resume='auto' to continue exactly where it stopped.")
        if self.stop_reason.startswith(DIVERGED):
            raise TrainingDiverged(f"trainstack: {self.stop_reason[len(DIVERGED) + 2:]}")
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
        """Collective: every rank calls it, rank 0 writes ``ckpt-e<epoch>-s<step>.pt`` (or ``best.pt``). Outside
        ``fit()`` (qadence's tests call the checkpoint callbacks directly) it writes into the run folder."""
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

    def _outside_fit_checkpointer(self) -> bool:
        """Give a Trainer used outside ``fit()`` a checkpointer for its run folder (the last fit's, the config's
        ``log_folder``, or a new one); True when it is outside a run."""
        if getattr(self, "checkpointer", None) is not None and getattr(self, "_train_loader", None) is not None:
            return False
        if self.run_folder is None:
            cfg = self.config
            self.run_folder = choose_run_folder(cfg.root_folder, cfg.log_folder, cfg.create_subfolder_per_run,
                                                cfg.resume)
        self.checkpointer = Checkpointer(self.run_folder, self.config.keep_last_checkpoints)
        return True

    # ------------------------------------------------------------------ the loop (every rank)
    def _fit(self) -> dict[str, Any] | None:
        try:
            self._start_run()
            self.callbacks.fire("train_start", self)
            while self.current_epoch < self._last_epoch and not self.stop_training:
                if not self._resume_at:
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
        return self._export()

    def _train_epoch(self) -> bool:
        """One pass over the training data (the rest of one after a mid-epoch resume); True when stopped early."""
        model, step, tracker, hb = self._ddp_model, self.step, self.tracker, heartbeat()
        n, loss_sum, sums = self._resume_at, self._resume_totals.get("loss_sum"), dict(self._resume_totals.get(
            "sums") or {})
        batches, left = self._epoch_iterator(n)
        if self._pending_rng is not None:  # restored only now: creating the iterator drew from the global RNG
            restore_rng(self._pending_rng)
        self._resume_at, self._resume_totals, self._pending_rng, self._resume_samples = 0, {}, None, None
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
                loss_sum = loss if loss_sum is None else loss_sum + loss
                for k, v in metrics.items():
                    sums[k] = v.detach() if k not in sums else sums[k] + v.detach()
                if on_end and self.global_step % on_end == 0:
                    self._fire_batch("train_batch_end", self.global_step, loss, metrics)
                if bar and self.global_step % bar == 0:
                    tracker.batch_end()
                if report and n % report == 0:
                    tracker.print(f"epoch {self.current_epoch + 1}: {n} batches so far (the training loader has no "
                                  f"length, so an epoch ends when it is exhausted; max_batches bounds it)")
                if self.global_step % poll == 0 and step.at_boundary and self._stop_now(n, loss_sum, sums):
                    return True
                hb.phase = "data"
        except Exception as exc:
            if self.global_step == self._first_step and hasattr(exc, "add_note"):
                exc.add_note(_first_step_note(batch))
            raise
        self.metrics = self._epoch_metrics("train", loss_sum, sums, n)
        self._epoch_base = 0
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
                                             nonfinite=self._loss_is_nonfinite())
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
        self.metrics.update(self._evaluate("val", self._val_loader))
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

    def _evaluate(self, phase: str, loader: Any) -> dict[str, float]:
        """Sample-weighted mean of loss and metrics over all ranks (the unwrapped model: no DDP sync)."""
        model = self.model
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        count = 0.0
        start, end = f"{phase}_batch_start", f"{phase}_batch_end"
        i, batch, hb = 0, None, heartbeat()
        hb.phase = "eval"
        with torch.no_grad():
            for i, batch in enumerate(epoch_batches(loader), 1):  # batch events count this pass's batches
                hb.tick += 1
                batch = self.accelerator.prepare_batch(batch)
                self._fire_batch(start, i)
                loss, metrics = call_loss(self.loss_fn, model, batch)
                size = float(_batch_size(batch))
                count += size
                for k, v in {"loss": loss, **metrics}.items():
                    totals[k] = totals.get(k, 0.0) + v.detach().float() * size
                self._fire_batch(end, i, loss, metrics)
            self._even_out_forwards(model, loader, i, batch)
        model.train(was_training)
        reduced = collectives.all_reduce_dict({**totals, "__count": count}, "sum")
        denom = max(float(reduced.pop("__count")), 1.0)
        return {f"{phase}_{k}": float(v) / denom for k, v in reduced.items()}

    def _even_out_forwards(self, model: nn.Module, loader: Any, done: int, batch: Any) -> None:
        """A sharded model's forward is a collective: ranks with fewer evaluation batches (the shards differ by one
        sample) run discarded forwards until every rank has run as many."""
        from ._fsdp import is_sharded

        if not is_sharded(model) or self.accelerator.world_size == 1:
            return
        most = int(collectives.all_reduce_dict({"n": float(done)}, "max")["n"])
        if most > done and batch is None:  # this rank had no batch at all: borrow one sample of the dataset
            batch = self.accelerator.prepare_batch(next(iter(DataLoader(_dataset_of(loader), batch_size=1))))
        for _ in range(most - done):
            call_loss(self.loss_fn, model, batch)

    # ------------------------------------------------------------------ stopping
    def _epoch_iterator(self, n: int) -> tuple[Iterator[Any], int | None]:
        """This pass's batches after the first ``n`` (and how many are left): a prepared loader jumps to the saved
        global sample position without loading what it skips; any other loader replays ``n`` batches."""
        loader, cap = self._train_loader, self._per_epoch if self._capped else None
        if self._resume_samples is not None and getattr(loader, "can_skip", False):
            loader.skip_samples(self._resume_samples)
            left = loader.batches_next_pass() if cap is None else min(loader.batches_next_pass(), cap - n)
            return iter(epoch_batches(loader, 0, left if cap is not None else None)), left
        left = None if self._per_epoch is None else self._per_epoch - n
        return iter(epoch_batches(loader, n, left if cap is not None else None)), left

    def _position(self, n: int) -> dict[str, Any]:
        """Where this epoch stands after ``n`` batches: also as global samples, which any world size can continue."""
        spb = getattr(self._train_loader, "samples_per_step", None)
        base = self._epoch_base
        if spb is None:
            samples = None
        elif isinstance(spb, dict):
            samples = {k: (base.get(k, 0) if isinstance(base, dict) else 0) + n * v for k, v in spb.items()}
        else:
            samples = base + n * spb
        return {"batch_in_epoch": n, "samples_in_epoch": samples, "world_size": self.accelerator.world_size}

    def _stop_now(self, n: int, loss_sum: Any, sums: dict[str, Any]) -> bool:
        """Every rank asks at the same step; if any rank was asked to stop, all save and stop together."""
        _, why = self.stopper.agree(self.accelerator.world_size)
        if why is None:
            return False
        self._partial = {**self._position(n), "loss_sum": loss_sum, "sums": sums}
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

    def _loss_is_nonfinite(self) -> bool:
        loss = self.metrics.get("train_loss")
        return self.config.stop_on_nonfinite and loss is not None and not math.isfinite(float(loss))

    def _stop_diverged(self) -> None:
        loss = self.metrics.get("train_loss")
        kept = self.checkpointer.latest()
        self.stop_training = True
        self.stop_reason = (f"{DIVERGED}: the training loss became {float(loss) if loss is not None else 'NaN'} in "
                            f"epoch {self.current_epoch} (on at least one rank), so training stopped; "
                            + (f"the last finite checkpoint, {kept}, is kept. " if kept else "no checkpoint was "
                               "written. ")
                            + "HINT: lower the learning rate, set grad_clip_norm, check the data for NaN/inf, or set "
                              "TrainConfig(stop_on_nonfinite=False) to train on.")
        self.tracker.print(f"trainstack: {self.stop_reason[len(DIVERGED) + 2:]}")

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
        self._train_loader = self._prepare_train(self.train_dataloader, cfg.seed or 0)
        self._val_loader = _prepare_eval(self.val_dataloader, acc.rank, acc.world_size)
        self._per_epoch = batches_per_epoch(self._train_loader, self.max_batches)
        self._capped = bool(self.max_batches) or is_infinite(self._train_loader)
        if self._per_epoch is None:
            self.console_print("trainstack: WARNING: the training loader has no length (an IterableDataset): each "
                               "epoch runs until it is exhausted, so a never-ending stream never finishes its first "
                               "epoch. HINT: set max_batches (batches per epoch), or mark the dataset `infinite = "
                               "True` (then max_batches, or 1, batches per epoch, as qadence).")
        self.step = make_step(cfg, self.optimizer, self.loss_fn, self.optimize_step, self.use_grad, acc.device,
                              acc.data_dtype)
        self.stopper = GracefulStop(resolve_signals(cfg.stop_signals),
                                    cfg.stop_file or os.environ.get("TRAINSTACK_STOP_FILE"))
        self.stopper.install()
        self.run_folder = self._agree_on_folder()
        sharded = cfg.checkpoint_format == "sharded" or cfg.checkpoint_format == "auto" and cfg.strategy == "fsdp"
        self.checkpointer = Checkpointer(self.run_folder, cfg.keep_last_checkpoints, acc.is_main_process, sharded,
                                         cfg.async_checkpoint)
        watchdog.start(acc.rank, acc.world_size, watchdog.resolve_timeout(cfg.hang_timeout), self.run_folder,
                       watchdog.default_store(), armed=True)
        self.callbacks = CallbackManager(self._user_callbacks(), acc.is_main_process)
        self._resume_at, self._resume_totals, self._pending_rng, self._best_val = 0, {}, None, math.inf
        self._partial = None
        self._resume_samples, self._epoch_base = None, 0
        self._run_start, restored = self.current_epoch, None
        self._run_identity = self._run_identity or self._identity()  # before any step changes the learning rate
        if cfg.resume is not None:  # before the banner, so it shows where training continues
            restored = self.checkpointer.restore(self._parts(), None if cfg.resume == "auto" else cfg.resume,
                                                 rank=acc.rank)
            if restored is not None:
                self._apply(restored)
            elif cfg.resume == "auto":
                self.console_print(f"trainstack: resume='auto' found no checkpoint in {self.run_folder}; starting "
                                   f"from scratch.")
        self._last_epoch = self._run_start + cfg.max_iter
        self._first_step = self.global_step
        earlier = [r for r in cfg.__dict__.get("_runs", []) if r != self.run_folder]
        if earlier and not self._continues and restored is None:
            self.console_print(
                f"trainstack: NOTE: this TrainConfig already trained a run in {earlier[-1]}; this Trainer starts a "
                f"NEW run in {self.run_folder}, from scratch (qadence reused the folder and continued). HINT: to "
                f"continue that run, TrainConfig(log_folder={str(earlier[-1])!r}, resume='auto').")
        if self._continues and self.current_epoch and restored is None:
            self.console_print(f"trainstack: a second fit() continues the run in {self.run_folder} at epoch "
                               f"{self.current_epoch} for another max_iter={cfg.max_iter} epochs.")
        if restored is not None and self.current_epoch >= self._last_epoch:
            self.console_print(
                f"trainstack: NOTHING TO TRAIN: the run in {self.run_folder} already finished epoch "
                f"{self.current_epoch} of its max_iter={cfg.max_iter} (max_iter counts from the run's start, not "
                f"from this resume; qadence trained another max_iter). HINT: raise max_iter to train longer, or "
                f"start a new run (resume=None, or another log_folder).")
        self.tracker = Tracker(cfg, self.run_folder, acc.is_main_process, self.current_epoch, self._last_epoch,
                               self._per_epoch, keep_through=int(restored.counters["global_step"]) if restored else None,
                               clock=self._clock)
        self.tracker.start(self._banner_info())

    def _claim_folder(self) -> tuple[Path, RunLock]:
        """Pick the run folder, refuse to overwrite another run's checkpoints, lock it, clear stale temp files.
        ``resume="auto"`` choosing among earlier runs skips one another run claims at the same moment, and runs of
        another experiment (other seed, optimizer settings, ...)."""
        cfg = self.config
        racing = auto_chosen(cfg.log_folder, cfg.create_subfolder_per_run, cfg.resume) and not self._continues
        busy: list[Path] = []
        while True:
            folder = self.run_folder if self._continues and self.run_folder is not None else choose_run_folder(
                cfg.root_folder, cfg.log_folder, cfg.create_subfolder_per_run, cfg.resume,
                accept=self._same_experiment if racing else None, skip=busy)
            if not self._continues:
                refuse_to_overwrite(folder, cfg.resume)
            lock = RunLock(folder)
            try:
                lock.acquire()
            except RunFolderBusy:
                if not racing or len(busy) > 20:
                    raise
                busy.append(folder)  # claimed by another run since we looked: take the next one
                continue
            Checkpointer(folder).remove_stale_temp_files()
            return folder, lock

    def _identity(self) -> dict[str, Any]:
        """What makes two runs the same experiment (stored in checkpoints): the settings that change what is
        trained, and the optimizer's class and hyperparameters -- not the duration, cadence or layout."""
        same = ("seed", "gradient_accumulation_steps", "grad_clip_norm", "mixed_precision", "strategy", "dtype",
                "max_batches")
        out: dict[str, Any] = {name: repr(getattr(self.config, name)) for name in same}
        opt = self.optimizer
        out["optimizer"] = type(opt).__name__
        groups = getattr(opt, "param_groups", None) or []
        out["hyperparameters"] = [repr({k: v for k, v in g.items() if k not in ("params", "initial_lr") and isinstance(
            v, (int, float, str, bool, tuple, type(None)))}) for g in groups]
        return out

    def _same_experiment(self, folder: Path) -> bool:
        """Whether ``folder``'s newest checkpoint was written by this experiment (one from before trainstack
        recorded it is taken as the same)."""
        try:
            found = Checkpointer(folder, is_main=False).load()
        except CheckpointError:
            return False
        theirs = found[0].get("identity") if found else None
        mine = self._run_identity or self._identity()
        if theirs is None or theirs == mine:
            return True
        differ = sorted(k for k in mine if theirs.get(k) != mine[k])
        self.console_print(f"trainstack: resume='auto' passes over {folder}: another experiment ran there "
                           f"({', '.join(differ)} differ).")
        return False

    def _check_resume_fits(self) -> None:
        """Before spawning: the checkpoint to resume from must fit the model (a clear error here, not in a worker)."""
        from .checkpoint import check_fits

        cfg = self.config
        if cfg.resume is None or self.run_folder is None:
            return
        target = Checkpointer(self.run_folder, is_main=False).readable_latest() if cfg.resume == "auto" \
            else Path(cfg.resume)
        if target is not None and target.exists():
            check_fits(self.model, target)

    def _agree_on_folder(self) -> Path:
        """Rank 0 claims the run folder (unless its launching process did); every rank gets it or the same error."""
        acc = self.accelerator
        self._lock = None
        choice: tuple[str | None, str | None] = (str(self.run_folder), None) if self._claimed else (None, None)
        if acc.is_main_process and not self._claimed:
            try:
                folder, self._lock = self._claim_folder()
                choice = (str(folder), None)
            except ConfigError as exc:
                choice = (None, str(exc))
        folder, error = acc.broadcast(choice)
        if error is not None:
            raise ConfigError(error)
        return Path(folder)

    def _prepare_train(self, loader: Any, seed: int) -> Any:
        acc = self.accelerator

        def prepare(dl: Any) -> Any:
            if isinstance(dl, torch.utils.data.DataLoader):
                return prepare_dataloader(dl, acc.rank, acc.world_size, seed=seed, pin_memory=acc.pin_memory)
            return dl

        return loader.prepared(prepare) if isinstance(loader, DictDataLoader) else prepare(loader)

    def _close(self) -> None:
        """Release what the run holds; never raises over the error that ended the run."""
        stopper, lock = getattr(self, "stopper", None), getattr(self, "_lock", None)
        watchdog.stop()
        if stopper is not None:
            stopper.restore()
        self.tracker.close()
        if lock is not None:
            lock.release()
            self._lock = None

    # ------------------------------------------------------------------ state
    def _clock(self) -> int:
        """The step metric rows are stamped with (a resume keeps the rows up to its checkpoint's)."""
        return self.global_step

    def _counters(self) -> dict[str, Any]:
        """The loop's own state in a checkpoint; the parts (model, optimizer, ...) save themselves."""
        return {"epoch": self.current_epoch, "global_step": self.global_step, "run_start_epoch": self._run_start,
                "partial_epoch": self._partial or {"batch_in_epoch": 0}, "best_val_loss": self._best_val,
                "saved_at": time.time(), "identity": self._run_identity}

    def _user_callbacks(self) -> list[Any]:
        return list(self.config.callbacks) + ([self.scheduler] if self.scheduler else [])

    def _parts(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer if self.use_grad else None,
                "scheduler": self.scheduler, "scaler": getattr(self, "step", None), "callbacks": self.callbacks}

    def _apply(self, restored: Restored) -> None:
        """Take over a checkpoint's counters; a mid-epoch one continues at its batch with its partial sums."""
        c = restored.counters
        self.current_epoch, self.global_step = int(c["epoch"]), int(c["global_step"])
        self._run_start = int(c.get("run_start_epoch", 0))
        self._best_val = float(c.get("best_val_loss", math.inf))
        self._run_identity = c.get("identity") or self._run_identity
        if hasattr(self._train_loader, "set_epoch"):
            self._train_loader.set_epoch(self.current_epoch)
        world, saved_world = self.accelerator.world_size, restored.world_size
        resharded = self._take_position(c.get("partial_epoch") or {}, saved_world)
        if restored.rng is not None and not resharded:
            if self._resume_at:
                self._pending_rng = restored.rng  # restored once the epoch's iterator exists
            else:
                restore_rng(restored.rng)
        else:  # another layout: each rank's RNG is re-derived from the seed, the rank and the step (repeatable)
            derived = _derived_seed(self.config.seed or 0, self.accelerator.rank, self.global_step)
            self._pending_rng = None
            seed_everything(derived)
        where = f", batch {self._resume_at} of the epoch" if self._resume_at else ""
        if saved_world != world:
            where += (f"; resharded: written by {saved_world} process(es), continuing on {world} at global sample "
                      f"{self._resume_samples or 0} of the epoch, RNG re-derived")
        self.console_print(f"Resumed from {restored.path} (epoch {self.current_epoch}, step {self.global_step}"
                           f"{where}).")

    def _take_position(self, partial: dict[str, Any], saved_world: int) -> bool:
        """Continue a stopped epoch where it stopped; True when the layout changed (another number of processes)."""
        n = int(partial.get("batch_in_epoch", 0))
        self._resume_totals, self._resume_at, self._epoch_base, self._resume_samples = partial, n, 0, None
        samples = partial.get("samples_in_epoch")
        spb = getattr(self._train_loader, "samples_per_step", None)
        world = self.accelerator.world_size
        if not n or spb is None:
            if n and saved_world != world:
                log.warning("this loader cannot jump to a global sample position: the %d batches already trained "
                            "in the stopped epoch are replayed per rank.", n)
            return saved_world != world
        if samples is None:  # a checkpoint from before global positions: batches of the same layout
            samples = {k: n * v // world * saved_world for k, v in spb.items()} if isinstance(spb, dict) \
                else n * spb // world * saved_world
        self._resume_samples = samples
        if saved_world == world:
            self._epoch_base = {k: v - n * spb[k] for k, v in samples.items()} if isinstance(spb, dict) \
                else samples - n * spb
            return False
        self._resume_at, self._resume_totals, self._epoch_base = 0, {}, samples  # a new segment of the epoch
        return True

    def _export(self) -> dict[str, Any] | None:
        """Rank 0's final state for the launching process (CPU tensors); a sharded model is gathered whole first
        (a collective: every rank calls this)."""
        from ._fsdp import full_state, is_sharded

        if is_sharded(self.model):
            model_sd, optim_sd = full_state(self.model, self.optimizer if self.use_grad else None)
        else:
            model_sd = self.model.state_dict()
            optim_sd = self.optimizer.state_dict() if self.use_grad else None
        if not self.accelerator.is_main_process:
            return None
        return {"model": _to_cpu(model_sd), "optimizer": _to_cpu(optim_sd),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "callbacks": self.callbacks.state_dict(), "epoch": self.current_epoch,
                "global_step": self.global_step, "run_folder": str(self.run_folder),
                "metrics": {k: float(v) for k, v in self.metrics.items()}, "stop_reason": self.stop_reason,
                "identity": self._run_identity}

    def _absorb(self, result: dict[str, Any]) -> None:
        """Take rank 0's final state into the launching process's objects."""
        from ._fsdp import fqn_optimizer_to_indexed

        self.model.load_state_dict(result["model"])
        optim = result["optimizer"]
        if optim is not None:
            keys = [p for g in optim["param_groups"] for p in g["params"]]
            self.optimizer.load_state_dict(fqn_optimizer_to_indexed(optim) if keys and isinstance(keys[0], str)
                                           else optim)
        if result["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(result["scheduler"])
        CallbackManager(self._user_callbacks(), True).load_state_dict(result["callbacks"])
        self.current_epoch, self.global_step = result["epoch"], result["global_step"]
        self.run_folder = Path(result["run_folder"])
        self.metrics, self.stop_reason = result["metrics"], result["stop_reason"]
        self._run_identity = result.get("identity")

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker receives: configuration and state, not this process's run handles."""
        state = dict(self.__dict__)
        for key in ("_ddp_model", "_train_loader", "_val_loader", "step", "stopper", "checkpointer", "_lock"):
            state.pop(key, None)
        state["tracker"] = Tracker(self.config, None, is_main=False)
        return state

    # ------------------------------------------------------------------ helpers
    def _test(self, loader: Any) -> dict[str, float]:
        acc = self.accelerator
        acc.setup()
        if self.config.seed is not None:
            seed_everything(self.config.seed + acc.rank)
        self.callbacks = CallbackManager(list(self.config.callbacks), acc.is_main_process)  # test_* events
        self.model = acc.prepare_model(self.model) if acc.world_size == 1 else self.model.to(acc.device)
        return self._evaluate("test", _prepare_eval(loader, acc.rank, acc.world_size))

    def _epoch_metrics(self, phase: str, loss_sum: Any, sums: dict[str, Any], n: int) -> dict[str, Any]:
        if n == 0:
            return {}
        out = {f"{phase}_loss": loss_sum / n, **{f"{phase}_{k}": v / n for k, v in sums.items()}}
        if self.config.all_reduce_metrics:
            out = self.accelerator.all_reduce_dict(out)
        return out

    def _fire_batch(self, event: str, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        self._set_result(iteration, loss, metrics)
        self.callbacks.fire(event, self)

    def _set_result(self, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        res = self.opt_result
        res.iteration, res.model, res.optimizer = iteration, self.model, self.optimizer
        res.loss = self.metrics.get("train_loss") if loss is None else loss
        res.metrics = self.metrics if metrics is None else metrics
        res.rank, res.device = self.accelerator.rank, self.accelerator.device

    def _banner_info(self) -> dict[str, Any]:
        acc, cfg, loader = self.accelerator, self.config, self.train_dataloader
        per_proc = getattr(loader, "batch_size", None) or 1
        per_epoch = self._per_epoch
        steps = "unknown (the loader has no length)" if per_epoch is None else \
            math.ceil(per_epoch / cfg.gradient_accumulation_steps) * max(self._last_epoch - self.current_epoch, 0)
        info: dict[str, Any] = {
            "Num examples": _num_examples(loader), "Num epochs": self._last_epoch - self._run_start,
            "Batches per epoch": per_epoch if per_epoch is not None else "until the loader ends",
            "Processes": f"{acc.world_size} ({acc.backend} on {acc.device.type})",
            "Batch size per process": per_proc,
            "Total batch size (w. parallel & accumulation)": per_proc * acc.world_size
            * cfg.gradient_accumulation_steps,
            "Gradient accumulation steps": cfg.gradient_accumulation_steps,
            "Total optimization steps": steps, "Run folder": self.run_folder}
        hang = watchdog.resolve_timeout(cfg.hang_timeout)
        info["Hang watchdog"] = f"armed: {hang:g} s without progress (3x for the first step, checkpoints, " \
                                f"callbacks)" if hang else "off"
        if is_infinite(self._train_loader) and not self.max_batches:
            info["Batches per epoch"] = "1 (an endless loader; set max_batches for more)"
        if self.current_epoch:
            info["Continuing at epoch"] = self.current_epoch
        return info


def _prepare_eval(loader: Any, rank: int, world: int) -> Any:
    if isinstance(loader, DictDataLoader):
        return loader.prepared(lambda dl: prepare_eval_dataloader(dl, rank, world))
    return prepare_eval_dataloader(loader, rank, world) if loader is not None else None


_QADENCE_HOOKS = ("on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
                  "on_val_epoch_start", "on_val_epoch_end", "on_train_batch_start", "on_train_batch_end",
                  "on_val_batch_start", "on_val_batch_end", "on_test_batch_start", "on_test_batch_end")


def _refuse_qadence_hooks(cls: type) -> None:
    """qadence calls ``on_*`` methods of a Trainer subclass; trainstack does not, so overriding one would be
    silently ignored. Say so, with the callback that does the same."""
    overridden = [name for name in _QADENCE_HOOKS if any(name in vars(k) for k in cls.__mro__ if k is not Trainer)]
    if overridden:
        event = overridden[0][3:]
        raise ConfigError(f"{cls.__name__} overrides {', '.join(overridden)}, which trainstack never calls (qadence "
                          f"did). HINT: use a callback instead: TrainConfig(callbacks=[Callback(on={event!r}, "
                          f"callback=lambda trainer, config, writer: ...)]).")


def _derived_seed(seed: int, rank: int, step: int) -> int:
    """A per-rank seed for a resharded resume: deterministic, and different per rank and per step."""
    return (seed * 1_000_003 + step * 7_919 + rank) % (2**31 - 1)


def _describe(batch: Any, depth: int = 0) -> str:
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).replace('torch.', '')}{list(batch.shape)}"
    if isinstance(batch, dict) and depth < 2:
        return "{" + ", ".join(f"{k!r}: {_describe(v, depth + 1)}" for k, v in list(batch.items())[:6]) + "}"
    if isinstance(batch, (list, tuple)) and depth < 2:
        return f"{type(batch).__name__}(" + ", ".join(_describe(v, depth + 1) for v in batch[:6]) + ")"
    return type(batch).__name__


def _first_step_note(batch: Any) -> str:
    return (f"trainstack: the first training step failed. loss_fn is called as loss_fn(model, batch), where model is "
            f"the module being trained and batch is one item of the DataLoader (here: {_describe(batch)}), after it "
            f"was moved to the device. A loss written as loss(output, target), or a batch that does not fit the "
            f"model's input, fails like this.")


def _dataset_of(loader: Any) -> Any:
    if isinstance(loader, DictDataLoader):
        raise ConfigError("evaluating a sharded (fsdp) model on a dict of loaders needs every rank to hold at least "
                          "one batch: use at least as many samples per loader as processes.")
    return loader.dataset


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
    if isinstance(loader, DictDataLoader):
        return {k: _num_examples(v) for k, v in loader.dataloaders.items()}
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return "unknown"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj

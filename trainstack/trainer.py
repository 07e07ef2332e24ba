"""`Trainer`: the training loop. Correct under any number of processes, resumable exactly.

Example::

    from trainstack import Trainer, TrainConfig

    config = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=50, print_every=5)
    model, optimizer = Trainer(model, optimizer, config, loss_fn="mse").fit(dataloader)

The loop (``Trainer._fit``, ``Trainer._train_epoch``, ``Trainer._at_step``, ``Trainer._end_epoch``)
reads top to bottom and calls its collaborators by name, each in the training room (``trainstack._train``) or
below it: ``self.step`` turns a batch into an optimizer step, ``self.schedule`` says which duties fall on which
step, ``self.cursor`` knows where a resumed epoch stands, ``self.checkpointer`` saves and restores,
``self.stopper`` makes the ranks agree on stopping, ``self.evaluate`` validates, tests and predicts,
``self.tracker`` prints, writes and plots (rank 0), and ``self.callbacks`` are the user's.

Counters: ``current_epoch`` (finished epochs), ``global_step`` (optimizer steps), ``global_batch`` (batches).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from . import _jobevents as jobevents
from ._runtime import compiling, watchdog
from ._runtime.preemption import GracefulStop
from ._runtime.watchdog import heartbeat
from ._train import devrun, handoff, notes, qadence, run
from ._train.evaluate import Evaluator, default_predict
from ._train.handoff import DIVERGED, INTERRUPTED, PREEMPTED
from ._train.live import timed
from ._train.metrics import EpochSums, MetricLog, nonfinite_loss
from ._train.qadence import UseGrad, check_optimizer, refuse_qadence_hooks
from ._train.resume import EpochCursor
from ._train.runfolder import RunFolder, run_identity
from ._train.schedule import Schedule
from ._train.steps import AMP_DTYPES, Step, autocast_precision, check_step_options, get_loss_fn, optimize_step
from ._train.tracker import Tracker
from .accelerator import Accelerator, seed_everything
from .callbacks import CallbackManager, LRScheduler, ModelCheckpoint, OptimizeResult
from .checkpoint import Checkpointer, restore_rng
from .config import TrainConfig
from .data import check_loader
from .errors import ConfigError

__all__ = ["Trainer"]

log = logging.getLogger(__name__)


def _accelerator_for(config: TrainConfig, model: nn.Module, compiled_by_user: bool = False) -> Accelerator:
    """The runtime a TrainConfig asks for (the Trainer runs its own hang watchdog, with heartbeats from its loop);
    FSDP blocks the model does not have are an error here, before any process starts. A model the user compiled
    is compiled again in place (default options) unless ``compile`` says how."""
    if config.strategy == "fsdp" and config.fsdp_blocks:
        from ._runtime.fsdp import check_blocks

        check_blocks(model, config.fsdp_blocks)
    return Accelerator(
        nprocs=config.nprocs, compute_setup=config.compute_setup, log_setup=config.log_setup, dtype=config.dtype,
        backend=config.backend, strategy=config.strategy, fsdp_blocks=config.fsdp_blocks,
        fsdp_min_params=config.fsdp_min_params, hang_timeout=0, compile=config.compile or compiled_by_user,
        fsdp_param_dtype=torch.bfloat16 if config.strategy == "fsdp" and config.mixed_precision == "bf16" else None)


def _is_factory(scheduler: Any) -> bool:
    """``scheduler=lambda optimizer, total_steps: ...``: a callable that is not itself a scheduler."""
    return callable(scheduler) and not hasattr(scheduler, "state_dict")


def planned_steps(config: TrainConfig, loader: Any, max_batches: int | None, world_size: int) -> int | None:
    """Optimizer steps of a whole run: ``max_iter`` epochs of one rank's shard, over accumulation, capped by
    ``max_steps``; None when an epoch's length is unknown and no ``max_steps`` bounds it."""
    from .data import batches_per_epoch, prepare_train

    shard = prepare_train(loader, 0, world_size, config.seed or 0, False) if loader is not None else None
    batches = batches_per_epoch(shard, max_batches)
    by_epochs = None if batches is None else config.max_iter * -(-batches // config.gradient_accumulation_steps)
    if config.max_steps is not None:
        return config.max_steps if by_epochs is None else min(by_epochs, config.max_steps)
    return by_epochs


def _fit_entry(trainer: Trainer) -> dict[str, Any] | None:
    """Runs in every process (module-level so it pickles)."""
    return trainer._fit()


def _eval_entry(trainer: Trainer, kind: str, loader: Any, predict_fn: Any = None) -> Any:
    """``test`` or ``predict`` in every process: rank 0's result comes back."""
    acc = trainer.accelerator
    acc.setup()
    if trainer.config.seed is not None:
        seed_everything(trainer.config.seed + acc.rank)
    trainer.callbacks = CallbackManager(list(trainer.config.callbacks), acc.is_main_process)  # test_* events
    evaluator = Evaluator(acc, trainer.loss_fn, trainer._fire_batch,
                          AMP_DTYPES.get(autocast_precision(trainer.config)))
    if kind == "predict":
        return evaluator.predict(trainer.model, loader, predict_fn)
    return evaluator.test(trainer.model, loader)


class Trainer:
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` processes.

    ``loss_fn`` is ``"mse"``, ``"cross_entropy"`` or ``(model, batch) -> loss | (loss, metrics)``; metrics are
    reported with ``train_``/``val_``/``test_`` prefixes. ``optimize_step`` defaults to a closure-based step
    (LBFGS works). ``scheduler`` is any ``torch.optim.lr_scheduler``, stepped after every epoch
    (``scheduler_interval="epoch"``) or after every optimizer step (``"step"``; gradient accumulation counts once),
    or ``lambda optimizer, total_steps: scheduler``, built at ``fit()`` with the run's planned optimizer steps
    (``estimated_stepping_batches``)."""

    _use_grad: ClassVar[bool] = True
    # What one run holds on each rank (set by _train.run.start, dropped when the Trainer is pickled to workers):
    step: Step
    schedule: Schedule
    checkpointer: Checkpointer
    stopper: GracefulStop
    evaluate: Evaluator
    _ddp_model: nn.Module
    _train_loader: Any
    _val_loader: Any
    _per_epoch: int | None  # batches per epoch (None: until the loader ends); _capped: stop after them anyway
    _capped: bool
    _last_epoch: int
    _last_step: int
    _first_step: int  # the step (and _first_epoch) this run started at: the end summary, the first-step note
    _first_epoch: int
    run_id: str | None = None  # the run's id across restarts (run.json, every checkpoint, the trackers)
    _folder: RunFolder | None
    _started: float  # time.monotonic() at the first step of this run

    def __init__(self, model: nn.Module, optimizer: Any, config: TrainConfig, loss_fn: Any = "mse",
                 train_dataloader: Any = None, val_dataloader: Any = None, test_dataloader: Any = None,
                 optimize_step: Any = optimize_step, max_batches: int | None = None, scheduler: Any = None,
                 scheduler_interval: str = "epoch") -> None:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a trainstack TrainConfig, got {type(config).__name__}.")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if scheduler_interval not in ("epoch", "step"):
            raise ConfigError(f"scheduler_interval={scheduler_interval!r}: must be 'epoch' (step the scheduler after "
                              f"every epoch) or 'step' (after every optimizer step).")
        model, compiled_by_user = compiling.unwrap_compiled(model)  # checkpoints hold the plain module's keys
        self.model, self.optimizer, self.config = model, optimizer, config
        refuse_qadence_hooks(type(self), Trainer)
        check_optimizer(optimizer, self.use_grad)
        self.loss_fn = get_loss_fn(loss_fn)
        self.optimize_step = optimize_step
        self.train_dataloader = check_loader(train_dataloader, "training")
        self.val_dataloader = check_loader(val_dataloader, "validation")
        self.test_dataloader = check_loader(test_dataloader, "test")
        self.max_batches = max_batches if max_batches is not None else config.max_batches
        self.scheduler_interval = scheduler_interval
        self._scheduler_factory = scheduler if _is_factory(scheduler) else None  # built at fit(): needs the steps
        self.scheduler = LRScheduler(scheduler, on="optimizer_step" if scheduler_interval == "step" else
                                     "train_epoch_end") if scheduler is not None and not _is_factory(scheduler) \
            else None
        self.accelerator = _accelerator_for(config, model, compiled_by_user)
        check_step_options(config, optimizer, self._custom_step, self.use_grad, self.accelerator.use_cuda)
        self.current_epoch = self.global_step = self.global_batch = 0
        self.run_folder: Path | None = None
        self.stop_training, self.stop_reason = False, ""
        self.metrics: dict[str, Any] = {}
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.callbacks = CallbackManager(list(config.callbacks), True)
        self.tracker = Tracker(config, None, is_main=False)
        self.cursor = EpochCursor()
        self.log_values = MetricLog()  # what trainer.log() collects until the next log line
        self._keeper = ModelCheckpoint(monitor="val_loss", filename="best", criterion=config.validation_criterion,
                                       min_delta=config.val_epsilon) if config.checkpoint_best_only else None
        self._claimed: Path | None = None  # set by fit() while the launching process holds the run folder
        self._continues = False  # set by fit(): this fit() continues the run of an earlier one
        self._run_identity: dict[str, Any] | None = None  # this experiment's, as its checkpoints record it
        self._run_start = self._run_start_step = 0
        self._val_step = -1  # the step of the latest validation (never twice at one step)

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
        """Train for ``config.max_iter`` epochs (or ``max_steps`` optimizer steps, whichever comes first); returns
        ``(model, optimizer)`` holding rank 0's final state. A first Ctrl-C stops at the next step boundary with a
        checkpoint (raising ``Interrupted``), a second one aborts; a second ``fit()``
        continues the run for another ``max_iter`` epochs."""
        devrun.refuse_after(self)
        if self.config.fast_dev_run:
            return devrun.fast_dev_run(self, train_dataloader, val_dataloader)
        if train_dataloader is not None:
            self.train_dataloader = check_loader(train_dataloader, "training")
        if val_dataloader is not None:
            self.val_dataloader = check_loader(val_dataloader, "validation")
        cfg = self.config
        run.check_validation(cfg, self.val_dataloader)
        if self._scheduler_factory is not None and self.scheduler is None:
            self.scheduler = run.build_scheduler(self._scheduler_factory, self.optimizer,
                                                 self.estimated_stepping_batches, self.scheduler_interval)
        self.stop_training, self.stop_reason = False, ""
        # a second fit() on this Trainer continues its run folder (unless a new folder per run is asked for)
        self._continues = self.run_folder is not None and not cfg.create_subfolder_per_run
        plan = self.accelerator.plan
        folder = RunFolder(cfg, self._run_identity or run_identity(cfg, self.optimizer), self.console_print)
        try:
            if plan.spawn and plan.rank_offset == 0:  # this process launches rank 0: it claims the run folder, so a
                self._claimed = folder.claim(self.run_folder if self._continues else None)  # busy one errs here
                self.run_folder = self._claimed
                folder.fits(self.model, self._claimed)
            held = [folder.lock.fileno()] if folder.lock is not None else []  # spawned workers keep it locked too
            result = self.accelerator.distribute(_fit_entry, keep_open=held, interruptible=True)(self)
        finally:
            self._claimed = None
            folder.release()
        if plan.spawn and result is not None:
            handoff.absorb(self, result, CallbackManager(self._user_callbacks(), True))
        handoff.conclude(self)  # a stopped run raises: Preempted/Interrupted (resume me) or TrainingDiverged
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """Evaluate on the given (or constructor) loader, reduced over all ranks without padding duplicates."""
        loader = check_loader(test_dataloader, "test") if test_dataloader is not None else self.test_dataloader
        if loader is None:
            raise ConfigError("test() needs a DataLoader: test(loader) or Trainer(..., test_dataloader=loader).")
        return self.accelerator.distribute(_eval_entry)(self, "test", loader)

    def predict(self, dataloader: Any, predict_fn: Any = None) -> Any:
        """The model's outputs for every sample of ``dataloader``, in dataset order, in this process -- on any number
        of processes, without padding duplicates. ``predict_fn(model, batch)`` (default: ``model(inputs)``) returns
        a tensor (or a tuple/list/dict of tensors) with one row per sample; the rows are concatenated."""
        loader = check_loader(dataloader, "predict")
        if loader is None:
            raise ConfigError("predict() needs a DataLoader: trainer.predict(loader).")
        if predict_fn is not None and not callable(predict_fn):
            raise ConfigError(f"predict_fn={predict_fn!r} must be a function (model, batch) -> outputs.")
        return self.accelerator.distribute(_eval_entry)(self, "predict", loader, predict_fn or default_predict)

    def log(self, name: str | dict[str, Any], value: Any = None, *, reduce: str = "mean",
            sync_dist: bool = False) -> None:
        """Log a value, or a dict of them: reduced over the steps until the next log line (``reduce``: mean, sum,
        max, min) and, with ``sync_dist=True``, over the ranks (then every rank must log it at the same steps).
        Logged values reach the live line, metrics.jsonl, the tracker, the loss plot and ``ModelCheckpoint``."""
        for key, val in (name.items() if isinstance(name, dict) else [(name, value)]):
            self.log_values.add(key, val, reduce, sync_dist)

    def log_dict(self, values: dict[str, Any], *, reduce: str = "mean", sync_dist: bool = False) -> None:
        """Lightning's spelling of ``log(dict)``."""
        self.log(values, reduce=reduce, sync_dist=sync_dist)

    @property
    def callback_metrics(self) -> dict[str, Any]:
        """The newest value of every metric: the epoch's and validation's, and what was logged since the last line."""
        return {**self.metrics, **self.log_values.current()}

    @property
    def estimated_stepping_batches(self) -> int | None:
        """The optimizer steps one run of ``fit()`` takes from its start (Lightning's name): ``max_iter`` epochs of
        this process's share of the training loader, over gradient accumulation, capped by ``max_steps`` -- right
        for the world size of ``nprocs``, torchrun and srun alike. None when the loader has no length. Size a step
        schedule with it, or pass ``scheduler=lambda optimizer, total_steps: ...``, which gets it."""
        return planned_steps(self.config, self.train_dataloader, self.max_batches, self.accelerator.plan.world_size)

    @property
    def is_global_zero(self) -> bool:
        """True in the process of rank 0 (Lightning's name): under python train.py the code after ``fit()`` runs
        once, in the launching process (rank 0); under torchrun or srun it runs in every rank's process."""
        return self.accelerator.is_main_process

    @property
    def validates(self) -> bool:
        """Whether this run validates (a validation loader and ``val_every`` or ``val_every_n_steps``)."""
        return self.val_dataloader is not None and bool(self.config.val_every or self.config.val_every_n_steps)

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's module (the DDP wrapper used for training is internal)."""
        return self.model

    @property
    def writer(self) -> Any:
        """Where callbacks write metrics (rank 0; a no-op elsewhere)."""
        return self.tracker.writer

    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop (agreed by an all-reduce at the next stop check or epoch end), with a final
        checkpoint."""
        self.stop_training, self.stop_reason = True, reason

    def console_print(self, text: str) -> None:
        """Print from rank 0 only."""
        if self.accelerator.is_main_process:
            print(text, flush=True)

    def save_checkpoint(self, best: bool = False, name: str | None = None,
                        monitor: dict[str, Any] | None = None) -> Path | None:
        """Collective: rank 0 writes ``ckpt-e<epoch>-s<step>.pt`` (``best.pt`` with ``best``; ``<name>.pt`` with
        ``name``, recording the ``monitor`` value that chose it); also outside ``fit()``."""
        run.outside_fit(self)
        counters = {**run.counters(self), **({"monitor": monitor} if monitor else {})}
        with watchdog.phase("checkpoint"):  # the hang watchdog allows saves more time
            return self.checkpointer.save(counters, self._parts(), self.config.to_dict(), best=best, name=name)

    def load_checkpoint(self, path: Any = None) -> bool:
        """Load on **every** rank: ``"best"``, ``"last"``, a path, or ``None`` (the newest readable checkpoint of the
        run folder). After ``fit()`` this puts e.g. the best weights into ``trainer.model`` for ``predict``."""
        devrun.refuse_after(self, "load")
        outside = run.outside_fit(self)
        where = self.checkpointer.resolve(path) if path in ("best", "last") else path
        restored = self.checkpointer.restore(self._parts(), where, rank=self.accelerator.rank)
        if restored is None:
            return False
        if outside:  # no loop to position: the model, optimizer and counters
            c = restored.counters
            self.current_epoch, self.global_step = int(c["epoch"]), int(c["global_step"])
            self.global_batch = int(c.get("global_batch", self.global_step))
        else:
            run.apply(self, restored)
        return True

    # ------------------------------------------------------------------ the loop (every rank)
    def _fit(self) -> dict[str, Any] | None:
        try:
            run.start(self)
            self.callbacks.fire("train_start", self)
            while self.current_epoch < self._last_epoch and self.global_step < self._last_step \
                    and not self.stop_training:
                if not self.cursor.batch:
                    self.callbacks.fire("train_epoch_start", self)
                if self._train_epoch():  # stopped mid-epoch: checkpoint written (or due), epoch not finished
                    break
                self.current_epoch += 1
                self._end_epoch()
            finished = not self.stop_reason.startswith((PREEMPTED, INTERRUPTED, DIVERGED))
            if finished:  # only a finished run has an end
                self._finish()
            with watchdog.phase("checkpoint"):
                self.checkpointer.wait()  # an asynchronous save in flight is committed before the run ends
            if finished and self.accelerator.is_main_process:
                self.stopper.confirm_finished(self.global_step)
                jobevents.record("finished", step=self.global_step, reason=self.stop_reason)
        finally:
            run.close(self)
        return handoff.export(self)

    def _train_epoch(self) -> bool:
        """One pass over the training data (the rest of one after a mid-epoch resume); True when stopped early."""
        model, step, schedule, hb = self._ddp_model, self.step, self.schedule, heartbeat()
        pending_rng = self.cursor.pending_rng
        n, totals, batches, left = self.cursor.begin(self._train_loader, self._per_epoch, self._capped)
        batches = timed(batches, self.tracker.live)  # the data-wait share in the live lines
        sums = EpochSums(totals)
        if pending_rng is not None:  # restored only now: creating the iterator drew from the global RNG
            restore_rng(pending_rng)
            self.cursor.pending_rng = None
        step.begin_epoch(left)
        self.tracker.live.epoch_start(sums, n, totals.get("interval"))
        end = n + left if left is not None else -1  # the epoch's last batch, when known
        model.train()
        on_start, on_end = self.callbacks.period("train_batch_start"), self.callbacks.period("train_batch_end")
        prepare, batch = self.accelerator.prepare_batch, None
        hb.phase = "data"
        try:
            for batch in batches:
                batch = prepare(batch)
                self.global_batch += 1
                if on_start and self.global_batch % on_start == 0:
                    self._fire_batch("train_batch_start", self.global_batch)
                loss, metrics = step(model, batch)
                n += 1
                hb.beats += 1
                sums.add(loss, metrics)
                boundary = step.at_boundary  # an optimizer step was taken (not half an accumulation window)
                if boundary:
                    self.global_step += 1
                    hb.step = self.global_step
                if on_end and self.global_batch % on_end == 0:
                    self._fire_batch("train_batch_end", self.global_batch, loss, metrics)
                if boundary and self.global_step >= schedule.next and self._at_step(n, sums, n == end):
                    return True
                hb.phase = "data"
        except Exception as exc:
            if self.global_step == self._first_step and hasattr(exc, "add_note") and not isinstance(exc, ConfigError):
                exc.add_note(notes.first_step_note(batch))
            raise
        self.metrics = self._epoch_means(sums, n)
        self.cursor.end_epoch()
        return False

    def _at_step(self, n: int, sums: EpochSums, epoch_end: bool) -> bool:
        """The duties the schedule puts on this optimizer step, in order: callbacks, lines, the bar; then (mid-epoch)
        validation, a checkpoint, the stop agreement, the step limit. True when training stops here; any checkpoint
        written here records this position in the epoch."""
        step, due = self.global_step, self.schedule.due(self.global_step)
        collective = due - {"log", "clock", "bar", "report"}
        if collective:
            self.cursor.stop_at(n, getattr(self._train_loader, "samples_per_step", None),
                                self.accelerator.world_size, sums.loss_sum, sums.sums, self.tracker.live.interval())
        if "optimizer_step" in due:
            self._fire_batch("optimizer_step", step)
        if "clock" in due:
            line, period = self.tracker.clock_due(step)
            self.schedule.set_period("clock", period, step)
            if line and "log" not in due:
                self._log_line(n, sums, row=False)
        if "log" in due:
            self._log_line(n, sums, row=True)
        if "bar" in due:
            self.tracker.bar_update(self.current_epoch, step, n)
        if "report" in due:
            self.tracker.print(notes.unbounded_progress(self.current_epoch, n))
        if not epoch_end and "val" in due:
            self._validate(self.tracker.position(self.current_epoch, n))
        if not epoch_end and "checkpoint" in due and not self.config.checkpoint_best_only:
            self.save_checkpoint()
        stopped = self._stop_here(due, epoch_end, sums, n)
        if not stopped:
            self.cursor.saved = None
        return stopped

    def _end_epoch(self) -> None:
        """Validation, callbacks and reports, then the ranks agree (one small collective) on stopping, then the
        checkpoint."""
        cfg, epoch, step = self.config, self.current_epoch, self.global_step
        if self._val_loader is not None and self._val_step != step and (
                cfg.val_every and epoch % cfg.val_every == 0
                or cfg.val_every_n_steps and step % cfg.val_every_n_steps == 0):
            self._validate()
        self._set_result(epoch)
        self.callbacks.fire("train_epoch_end", self)
        self.metrics.update(self.log_values.collect(self.accelerator.all_reduce_dict))  # what no line showed yet
        with watchdog.phase("callback"):  # plots and tracker writes may take a while on rank 0
            self.tracker.epoch_end(epoch, self.metrics, self.model, step)
        wants_stop = self.stop_training or bool(cfg.trainstop_criterion and cfg.trainstop_criterion(self))
        agreed, preempt = self.stopper.agree(self.accelerator.world_size, stop=wants_stop,
                                             nonfinite=cfg.stop_on_nonfinite and nonfinite_loss(self.metrics))
        if agreed["nonfinite"]:  # before saving: the last finite checkpoint must survive rotation
            run.stop_diverged(self)
            return
        if not cfg.checkpoint_best_only and (cfg.checkpoint_every and epoch % cfg.checkpoint_every == 0 or
                                             cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0):
            self.save_checkpoint()
        if preempt and epoch < self._last_epoch and step < self._last_step:
            run.stop_gracefully(self, preempt)
        elif agreed["stop"]:
            self.stop_training = True
            self.stop_reason = self.stop_reason or "trainstop_criterion returned True"
            self.tracker.print(f"Stopping after epoch {epoch}: {self.stop_reason}.")

    def _validate(self, position: float | None = None) -> None:
        """Validation at an epoch's end, or inside one at ``position`` (its callbacks then see the epoch in progress,
        1-based). What its callbacks log (``trainer.log`` in ``val_epoch_end``) belongs to it: every later callback
        sees it, and it is on the validation's line and row, at its step."""
        mid_epoch = position is not None
        epoch = self.current_epoch + 1 if mid_epoch else self.current_epoch
        self._set_result(epoch)
        training_log, self.log_values = self.log_values, MetricLog()
        try:
            self.callbacks.fire("val_epoch_start", self)
            values = self.evaluate("val", self.model, self._val_loader)
            self.metrics.update(values)
            self._val_step = self.global_step
            self._set_result(epoch)
            self.callbacks.fire("val_epoch_end", self)
            values.update(self.log_values.collect(self.accelerator.all_reduce_dict))
        finally:
            self.log_values = training_log
        self.metrics.update(values)
        self.tracker.validation(self.current_epoch if position is None else position, self.global_step, values,
                                row=mid_epoch)

    def _finish(self) -> None:
        """The end of a finished run: the final checkpoint, the user's train_end callbacks, the last reports."""
        if not self.config.checkpoint_best_only:
            self.save_checkpoint()
        self._set_result(self.current_epoch)
        self.callbacks.fire("train_end", self)
        with watchdog.phase("callback"):
            self.tracker.train_end(self.current_epoch, self.model)
        self.tracker.summary(time.monotonic() - self._started, (self.current_epoch, self.global_step),
                             (self._first_epoch, self._first_step), run.best(self), self.stop_reason, self.metrics)

    # ------------------------------------------------------------------ stopping
    def _stop_here(self, due: set[str], epoch_end: bool, sums: EpochSums, n: int) -> bool:
        """Mid-epoch stops: a graceful stop (signal, stop file, Ctrl-C), a stop any rank asked for (early stopping
        after a validation), or the step limit; the epoch's partial metrics become the run's."""
        if "poll" in due or ("val" in due and not epoch_end):
            agreed, why = self.stopper.agree(self.accelerator.world_size, stop=self.stop_training)
            if why is not None:
                run.stop_gracefully(self, why)
                return True
            if agreed["stop"] and not epoch_end:
                self.stop_training, self.stop_reason = True, self.stop_reason or "another rank asked to stop"
                self.tracker.print(f"Stopping at step {self.global_step}: {self.stop_reason}.")
        if "max_steps" in due and not epoch_end and not self.stop_training:
            self.stop_training, self.stop_reason = True, f"max_steps={self.config.max_steps} reached"
        if self.stop_training and not epoch_end:
            self.metrics = self._epoch_means(sums, n)
            return True
        return False

    # ------------------------------------------------------------------ state
    def _user_callbacks(self) -> list[Any]:
        return list(self.config.callbacks) + ([self.scheduler] if self.scheduler else []) + (
            [self._keeper] if self._keeper else [])

    def _parts(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer if self.use_grad else None,
                "scheduler": self.scheduler, "scaler": getattr(self, "step", None), "callbacks": self.callbacks}

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker receives: configuration and state, not this process's run handles."""
        return handoff.worker_state(self, Tracker(self.config, None, is_main=False))

    # ------------------------------------------------------------------ helpers
    def _epoch_means(self, sums: EpochSums, n: int) -> dict[str, Any]:
        return sums.means("train", n, self.accelerator.all_reduce_dict if self.config.all_reduce_metrics else None)

    def _log_line(self, n: int, sums: EpochSums, row: bool) -> None:
        position = self.tracker.position(self.current_epoch, n)
        self.tracker.step_line((self.current_epoch, self.global_step, position), sums, n,
                               self.optimizer if self.use_grad else None, self.log_values,
                               self.accelerator.all_reduce_dict if row else None, row)

    def _fire_batch(self, event: str, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        self._set_result(iteration, loss, metrics)
        self.callbacks.fire(event, self)

    def _set_result(self, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        res = self.opt_result
        res.iteration, res.model, res.optimizer = iteration, self.model, self.optimizer
        res.loss = self.metrics.get("train_loss") if loss is None else loss
        res.metrics = self.metrics if metrics is None else metrics
        res.rank, res.device = self.accelerator.rank, self.accelerator.device

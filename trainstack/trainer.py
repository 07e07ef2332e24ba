"""`Trainer`: the training loop. Correct under any number of processes, resumable exactly.

Example::

    from trainstack import Trainer, TrainConfig

    config = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=50, print_every=5)
    model, optimizer = Trainer(model, optimizer, config, loss_fn="mse").fit(dataloader)

The loop (``Trainer._fit``, ``Trainer._train_epoch``, ``Trainer._at_step``, ``Trainer._end_epoch``)
reads top to bottom and calls the collaborators of its ``Run`` (one ``fit()`` on this rank, ``trainstack._train.run``)
by name: ``run.step`` turns a batch into an optimizer step, ``run.schedule`` says which duties fall on which step
(and at an epoch's end), ``run.cursor`` knows where a resumed epoch stands, ``run.checkpointer`` saves and restores,
``run.stops`` makes the ranks agree on stopping, ``run.validator`` validates, ``run.tracker`` prints, writes and
plots (rank 0); ``self.callbacks`` are the user's.

Counters: ``current_epoch`` (finished epochs), ``global_step`` (optimizer steps), ``global_batch`` (batches).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ._common import jobevents as jobevents
from ._common.choices import SHARDING
from ._runtime import compiling, inplace, watchdog
from ._runtime.fsdp import Blueprint, is_sharded
from ._runtime.watchdog import heartbeat
from ._train import devrun, handoff, notes, run
from ._train.evaluate import Evaluator, default_predict
from ._train.live import timed
from ._train.metrics import EpochSums, MetricLog
from ._train.peers import Held
from ._train.progress import Progress, ProgressView, Stop
from ._train.qadence import GradModes, check_optimizer, refuse_qadence_hooks
from ._train.run import Run, outside_counters
from ._train.runfolder import Claim, RunFolder, run_identity, standalone_checkpointer
from ._train.schedule import Schedule
from ._train.steps import (
    AMP_DTYPES,
    autocast_precision,
    check_step_options,
    get_loss_fn,
    is_custom_step,
    optimize_step,
)
from ._train.tracker import Tracker
from .accelerator import Accelerator, retarget_optimizer, seed_everything
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
    if config.fsdp_blocks:
        from ._runtime.fsdp import check_blocks

        check_blocks(model, config.fsdp_blocks)
    return Accelerator(
        nprocs=config.nprocs, compute_setup=config.compute_setup, log_setup=config.log_setup, dtype=config.dtype,
        backend=config.backend, strategy=config.strategy, fsdp_blocks=config.fsdp_blocks,
        fsdp_min_params=config.fsdp_min_params, hang_timeout=0, compile=config.compile or compiled_by_user,
        fsdp_param_dtype=torch.bfloat16 if config.strategy in SHARDING and config.mixed_precision in ("bf16", "fp8")
        else None, hsdp_replicas=config.hsdp_replicas, tensor_parallel_size=config.tensor_parallel_size,
        parallelize_fn=config.parallelize_fn, activation_checkpointing=config.activation_checkpointing,
        float8=config.mixed_precision == "fp8",
        join_process_group=False)  # fit() joins (and leaves) the group around the run it distributes


def _is_factory(scheduler: Any) -> bool:
    """``scheduler=lambda optimizer, total_steps: ...``: a callable that is not itself a scheduler."""
    return callable(scheduler) and not hasattr(scheduler, "state_dict")


def _scheduler_of(scheduler: Any, interval: str) -> tuple[Any, LRScheduler | None]:
    """``(factory, None)`` for ``lambda optimizer, total_steps: ...`` (built at ``fit()``: it needs the steps), else
    ``(None, the scheduler as a callback stepping per epoch or per optimizer step)``."""
    if scheduler is None:
        return None, None
    if _is_factory(scheduler):
        return scheduler, None
    return None, LRScheduler(scheduler, on="optimizer_step" if interval == "step" else "train_epoch_end")


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


def _fit_entry(trainer: Trainer, claim: Claim) -> dict[str, Any] | None:
    """Runs in every process (module-level so it pickles); ``claim`` is the launching process's run folder."""
    return trainer._fit(claim)


def _fit_in_place(trainer: Trainer, entry: Callable[[Trainer, Claim], dict[str, Any] | None], claim: Claim
                  ) -> dict[str, Any] | None:
    """``entry`` (the loop on every rank); where a peer died and the driver continues this rank in place
    (``_runtime/inplace.py``), again in the next job step's process group, from this ``fit``'s start, holding the
    state of its last complete step (``_train/peers.py``): the restore then sets the position from it, or from the
    newest checkpoint where no rank holds one, as it would in a fresh process. A sharded model (HSDP) is built
    again over the new group's mesh from its blueprint, kept here before the first sharding."""
    start = copy.deepcopy(trainer.progress)
    blueprint = Blueprint(trainer.model) if trainer.config.strategy in SHARDING and not is_sharded(trainer.model) \
        and inplace.enabled(trainer.accelerator) else None
    if blueprint is not None:
        trainer.model = blueprint.own(trainer.model)  # the model passed in keeps placeholders: trainer.model trains
    while True:
        try:
            return entry(trainer, claim)
        except Exception as exc:
            if not inplace.may_wait(exc, trainer.accelerator):
                raise
            held = trainer._run.held() if trainer._run is not None else Held(None, moved=True)
            if trainer.config.strategy in SHARDING and (blueprint is None or held.state is None):
                raise  # a sharded model without its own complete step has nothing to continue with: relaunched
            error = inplace.detach(exc)
        claim = dataclasses.replace(claim, held=held)
        trainer._let_go()
        if blueprint is not None:  # the old model is bound to the failed group's mesh: a fresh one, the same names
            trainer.model, moved = blueprint.build(trainer.model, trainer.accelerator.device)
            if trainer.optimizer is not None:
                retarget_optimizer(trainer.optimizer, moved)
                trainer.optimizer.state.clear()  # the peers' state (or a checkpoint's) replaces it
        else:
            trainer.model.zero_grad(set_to_none=True)  # as in a fresh process: the failed step's gradients add up
        offer = inplace.next_step(error, trainer.accelerator)
        if offer is None:
            raise error
        trainer.progress, trainer.metrics = copy.deepcopy(start), {}
        inplace.join(trainer.accelerator, offer)


def _eval_entry(trainer: Trainer, kind: str, loader: Any, predict_fn: Any = None) -> Any:
    """``test`` or ``predict`` in every process: rank 0's result comes back."""
    acc = trainer.accelerator
    acc.setup()
    if trainer.config.seed is not None:
        seed_everything(trainer.config.seed + acc.rank)
    trainer.callbacks = CallbackManager(list(trainer.config.callbacks), acc.is_main_process)  # test_* events
    evaluator = Evaluator(acc, trainer.loss_fn, trainer._fire, AMP_DTYPES.get(autocast_precision(trainer.config)))
    if kind == "predict":
        return evaluator.predict(trainer.model, loader, predict_fn)
    return evaluator.test(trainer.model, loader)


def _eval_loader(kind: str, loader: Any) -> Any:
    """The loader ``test()``/``predict()`` evaluates, checked; none is an error with the call that gives one."""
    checked = check_loader(loader, kind)
    if checked is None:
        raise ConfigError("test() needs a DataLoader: test(loader) or Trainer(..., test_dataloader=loader)."
                          if kind == "test" else "predict() needs a DataLoader: trainer.predict(loader).")
    return checked


class Trainer(ProgressView, GradModes):
    """Train ``model`` with ``optimizer`` as ``config`` says, on ``config.nprocs`` processes.

    ``loss_fn`` is ``"mse"``, ``"cross_entropy"`` or ``(model, batch) -> loss | (loss, metrics)``; metrics are
    reported with ``train_``/``val_``/``test_`` prefixes. ``optimize_step`` defaults to a closure-based step
    (LBFGS works). ``scheduler`` is any ``torch.optim.lr_scheduler``, stepped after every epoch
    (``scheduler_interval="epoch"``) or after every optimizer step (``"step"``; gradient accumulation counts once),
    or ``lambda optimizer, total_steps: scheduler``, built at ``fit()`` with the run's planned optimizer steps
    (``estimated_stepping_batches``).

    The Trainer holds what crosses processes -- the user's objects, the config, the callbacks, the counters, the
    metrics and the stop state; what one ``fit()`` holds on a rank is its ``Run`` (``trainstack._train.run``).
    ``trainer.model`` is the model trained: where HSDP continues in place after a crash (srun under the driver), a
    module of ``model``'s structure the Trainer alone holds, ``model`` keeping meta placeholders."""

    _use_grad: ClassVar[bool] = True

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
        self._scheduler_factory, self.scheduler = _scheduler_of(scheduler, scheduler_interval)
        self.accelerator = _accelerator_for(config, model, compiled_by_user)
        check_step_options(config, optimizer, is_custom_step(optimize_step), self.use_grad)
        self.progress = Progress()  # epoch, step, batch and the stop: the Run advances it, the hand-off carries it
        self.run_folder: Path | None = None
        self.metrics: dict[str, Any] = {}
        self.opt_result = OptimizeResult(0, model, optimizer)
        self.callbacks = CallbackManager(list(config.callbacks), True)
        self.log_values = MetricLog()  # what trainer.log() collects until the next log line
        self._keeper = ModelCheckpoint(monitor="val_loss", filename="best", criterion=config.validation_criterion,
                                       min_delta=config.val_epsilon) if Schedule.best_only(config) else None
        self._identity: dict[str, Any] | None = None  # this experiment's, as its checkpoints record it
        self._run: Run | None = None  # this rank's current (or last) fit(); never pickled
        self._fast_dev_ran = False  # fast_dev_run trained the model: no real run on this Trainer

    # ------------------------------------------------------------------ public API
    def fit(self, train_dataloader: Any = None, val_dataloader: Any = None) -> tuple[nn.Module, Any]:
        """Train for ``config.max_iter`` epochs (or ``max_steps`` optimizer steps, whichever comes first); returns
        ``(model, optimizer)`` holding rank 0's final state. A first Ctrl-C stops at the next step boundary with a
        checkpoint (raising ``Interrupted``), a second one aborts; a second ``fit()``
        continues the run for another ``max_iter`` epochs."""
        devrun.refuse_after(self._fast_dev_ran)
        if self.config.fast_dev_run:
            try:
                return devrun.fast_dev_run(self, train_dataloader, val_dataloader)
            finally:
                self._fast_dev_ran = True  # its model took those steps, whatever happened
        if train_dataloader is not None:
            self.train_dataloader = check_loader(train_dataloader, "training")
        if val_dataloader is not None:
            self.val_dataloader = check_loader(val_dataloader, "validation")
        cfg = self.config
        Schedule.check_validation(cfg, self.val_dataloader)
        if self._scheduler_factory is not None and self.scheduler is None:
            self.scheduler = run.build_scheduler(self._scheduler_factory, self.optimizer,
                                                 self.estimated_stepping_batches, self.scheduler_interval)
        self.progress.resume()
        # a second fit() on this Trainer continues its run folder (unless a new folder per run is asked for)
        continuing = self.run_folder if not cfg.create_subfolder_per_run else None
        plan = self.accelerator.plan
        folder = RunFolder(cfg, self._identity or run_identity(cfg, self.optimizer), self.console_print)
        try:
            claim = folder.launch_claim(plan.spawn and plan.rank_offset == 0, continuing, self._identity, self.model)
            self.run_folder = claim.path or self.run_folder
            result = _fit_in_place(self, self.accelerator.distribute(_fit_entry, keep_open=folder.held_fds(),
                                                                     interruptible=True), claim)  # workers: locked
        finally:
            folder.release()
        if plan.spawn and result is not None:
            self._identity = handoff.absorb(self, result, CallbackManager(self._user_callbacks(), True))
        handoff.conclude(self)  # a stopped run raises: Preempted/Interrupted (resume me) or TrainingDiverged
        return self.model, self.optimizer

    def test(self, test_dataloader: Any = None) -> dict[str, float]:
        """Evaluate on the given (or constructor) loader, reduced over all ranks without padding duplicates."""
        loader = _eval_loader("test", test_dataloader if test_dataloader is not None else self.test_dataloader)
        return self.accelerator.distribute(_eval_entry)(self, "test", loader)

    def predict(self, dataloader: Any, predict_fn: Any = None) -> Any:
        """The model's outputs for every sample of ``dataloader``, in dataset order, in this process -- on any number
        of processes, without padding duplicates. ``predict_fn(model, batch)`` (default: ``model(inputs)``) returns
        a tensor (or a tuple/list/dict of tensors) with one row per sample; the rows are concatenated."""
        if predict_fn is not None and not callable(predict_fn):
            raise ConfigError(f"predict_fn={predict_fn!r} must be a function (model, batch) -> outputs.")
        loader = _eval_loader("predict", dataloader)
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
    def run(self) -> Run | None:
        """This rank's ``fit()`` under way (its step, schedule, checkpointer, reports); None outside one."""
        return self._active()

    unwrapped_model = property(lambda self: self.model, doc="The user's module (the DDP wrapper is internal).")

    def _let_go(self) -> None:
        """The failed run goes, with its wrapped model and the mesh it was laid out on: its process groups'
        connections close (restart in place)."""
        self._run = None
        self.accelerator.forget_mesh()

    @property
    def tracker(self) -> Tracker:
        """This rank's reports of the current (or last) run; a silent one before any."""
        return self._run.tracker if self._run is not None else Tracker(self.config, None, is_main=False)

    @property
    def writer(self) -> Any:
        """Where callbacks write metrics (rank 0; a no-op elsewhere)."""
        return self.tracker.writer

    @property
    def checkpointer(self) -> Checkpointer:
        """The checkpoints of the current run; outside ``fit()``, those of its last run folder (or the config's)."""
        active = self._active()
        if active is not None:
            return active.checkpointer
        self.run_folder, checkpointer = standalone_checkpointer(self.config, self.run_folder)
        return checkpointer

    @property
    def run_id(self) -> str | None:
        """The run's id across restarts (run.json, every checkpoint, the trackers); None before a run."""
        return self._run.run_id if self._run is not None else None

    def request_stop(self, reason: str) -> None:
        """Ask every rank to stop (agreed by an all-reduce at the next stop check or epoch end), with a final
        checkpoint."""
        self.progress.ask(Stop.REQUESTED, reason)

    def console_print(self, text: str) -> None:
        """Print from rank 0 only."""
        if self.accelerator.is_main_process:
            print(text, flush=True)

    def save_checkpoint(self, best: bool = False, name: str | None = None,
                        monitor: dict[str, Any] | None = None) -> Path | None:
        """Collective: rank 0 writes ``ckpt-e<epoch>-s<step>.pt`` (``best.pt`` with ``best``; ``<name>.pt`` with
        ``name``, recording the ``monitor`` value that chose it); also outside ``fit()``."""
        active, checkpointer = self._active(), self.checkpointer
        counters = {**(active.counters() if active is not None else
                       outside_counters(self, checkpointer, self._identity)),
                    **({"monitor": monitor} if monitor else {})}
        with watchdog.phase("checkpoint"):  # the hang watchdog allows saves more time
            return checkpointer.save(counters, self._parts(active), self.config.to_dict(), best=best, name=name)

    def load_checkpoint(self, path: Any = None) -> bool:
        """Load on **every** rank: ``"best"``, ``"last"``, a path, or ``None`` (the newest readable checkpoint of the
        run folder). After ``fit()`` this puts e.g. the best weights into ``trainer.model`` for ``predict``."""
        devrun.refuse_after(self._fast_dev_ran, "load")
        active, checkpointer = self._active(), self.checkpointer
        where = checkpointer.resolve(path) if path in ("best", "last") else path
        restored = checkpointer.restore(self._parts(active), where, rank=self.accelerator.rank)
        if restored is None:
            return False
        if active is not None:
            active.apply(restored)
        else:  # no loop to position: the model, optimizer and counters
            self.progress.restore(restored.counters)
        return True

    # ------------------------------------------------------------------ the loop (every rank)
    def _fit(self, claim: Claim) -> dict[str, Any] | None:
        self.callbacks = CallbackManager(self._user_callbacks(), self.accelerator.is_main_process)
        self._run = active = Run.open(self, claim, fire=self._fire, parts=self._parts)
        try:
            self.run_folder = active.path
            self.callbacks.fire("train_start", self)
            while self.current_epoch < active.last_epoch and self.global_step < active.last_step \
                    and not self.stop_training:
                if not active.cursor.batch:
                    self.callbacks.fire("train_epoch_start", self)
                if self._train_epoch(active):  # stopped mid-epoch: checkpoint written (or due), epoch not finished
                    break
                self.current_epoch += 1
                self._end_epoch(active)
            finished = self.progress.finished
            if finished:  # only a finished run has an end: the final checkpoint, train_end, the summary
                active.finish()
            with watchdog.phase("checkpoint"):
                active.checkpointer.wait()  # an asynchronous save in flight is committed before the run ends
            if finished and self.accelerator.is_main_process:
                active.stopper.confirm_finished(self.global_step)
                jobevents.record("finished", step=self.global_step, reason=self.stop_reason)
        finally:
            active.close(failed=sys.exc_info()[1] is not None)
        self._identity = active.identity
        return handoff.export(self, active.identity)

    def _train_epoch(self, active: Run) -> bool:
        """One pass over the training data (the rest of one after a mid-epoch resume); True when stopped early."""
        model, step, hb = active.model, active.step, heartbeat()
        cursor = active.cursor
        pending_rng = cursor.pending_rng
        n, totals, batches, left = cursor.begin(active.train_loader, active.per_epoch, active.capped)
        batches = timed(batches, active.tracker.live)  # the data-wait share in the live lines
        sums = EpochSums(totals)
        if pending_rng is not None:  # restored only now: creating the iterator drew from the global RNG
            restore_rng(pending_rng)
            cursor.pending_rng = None
        step.begin_epoch(left)
        active.tracker.live.epoch_start(sums, n, totals.get("interval"))
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
                    self.callbacks.fire("train_batch_start", self, self.global_batch)
                loss, metrics = step(model, batch)
                hb.phase = "after"  # callbacks, logs, duties: not the step's own time (stragglers, goodput)
                n += 1
                hb.beats += 1
                sums.add(loss, metrics)
                boundary = step.at_boundary  # an optimizer step was taken (not half an accumulation window)
                if boundary:
                    self.global_step += 1
                    hb.step = self.global_step
                if on_end and self.global_batch % on_end == 0:
                    self.callbacks.fire("train_batch_end", self, self.global_batch, loss, metrics)
                if boundary and self._at_step(active, n, sums, n == end):
                    return True
                hb.phase = "data"
        except Exception as exc:
            if self.global_step == active.first_step and hasattr(exc, "add_note") \
                    and not isinstance(exc, ConfigError):
                exc.add_note(notes.first_step_note(batch))
            raise
        self.metrics = active.epoch_means(sums, n)
        cursor.end_epoch()
        return False

    def _at_step(self, active: Run, n: int, sums: EpochSums, epoch_end: bool) -> bool:
        """The duties the schedule puts on this optimizer step, in order: callbacks, lines, the bar; then (mid-epoch)
        validation, a checkpoint, the stop agreement, the step limit. True when training stops here; any checkpoint
        written here records this position in the epoch. The step is complete once its optimizer and scheduler
        stepped: where a restart in place continues from (``active.completed``)."""
        if self.global_step < active.schedule.next:  # no duty on this step
            active.completed(n, sums)
            return False
        step, due, tracker = self.global_step, active.schedule.due(self.global_step), active.tracker
        if due - {"log", "clock", "bar", "report"}:  # a collective duty: a checkpoint here records the position
            active.cursor.stop_at(n, getattr(active.train_loader, "samples_per_step", None),
                                  self.accelerator.world_size, sums.loss_sum, sums.sums, tracker.live.interval)
        if "optimizer_step" in due:
            self.callbacks.fire("optimizer_step", self, step)
        active.completed(n, sums)  # before any collective duty
        if "clock" in due:
            line, period = tracker.clock_due(step)
            active.schedule.set_period("clock", period, step)
            if line and "log" not in due:
                active.log_line(n, sums, row=False)
        if "log" in due:
            active.log_line(n, sums, row=True)
        if "bar" in due:
            tracker.bar_update(self.current_epoch, step, n)
        if "report" in due:
            tracker.print(notes.unbounded_progress(self.current_epoch, n))
        if not epoch_end and "val" in due:
            active.validator(tracker.position(self.current_epoch, n))
        if not epoch_end and "checkpoint" in due:
            self.save_checkpoint()
        active.save_memory(due if not epoch_end else set())
        if active.stops.here(due, epoch_end):  # the epoch's partial metrics become the run's
            self.metrics = active.epoch_means(sums, n)
            return True
        active.cursor.saved = None
        return False

    def _end_epoch(self, active: Run) -> None:
        """Validation, callbacks and reports, then the ranks agree on stopping, the checkpoint, the stop."""
        epoch, step = self.current_epoch, self.global_step
        due = active.schedule.due_at_epoch_end(epoch, step)
        active.validator.at_epoch_end(due)
        self.callbacks.fire("train_epoch_end", self, epoch)
        self.metrics.update(self.log_values.collect(self.accelerator.all_reduce_dict))  # what no line showed yet
        with watchdog.phase("callback"):  # plots and tracker writes may take a while on rank 0
            active.tracker.epoch_end(epoch, self.metrics, self.model, step)
        active.stops.at_epoch_end(due)

    # ------------------------------------------------------------------ state
    def _active(self) -> Run | None:
        """The run of the ``fit()`` under way on this rank (None outside one)."""
        return self._run if self._run is not None and self._run.running else None

    def _user_callbacks(self) -> list[Any]:
        return list(self.config.callbacks) + ([self.scheduler] if self.scheduler else []) + (
            [self._keeper] if self._keeper else [])

    def _parts(self, active: Run | None) -> dict[str, Any]:
        """What a checkpoint holds, by name (the run's step holds the fp16 scaler)."""
        return {"model": self.model, "optimizer": self.optimizer if self.use_grad else None,
                "scheduler": self.scheduler, "scaler": active.step if active is not None else None,
                "callbacks": self.callbacks}

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned worker receives: configuration and state, never this process's run."""
        return {**self.__dict__, "_run": None}

    def _fire(self, event: str, iteration: int, loss: Any = None, metrics: dict | None = None) -> None:
        """A batch event of the evaluator, for this Trainer's callbacks."""
        self.callbacks.fire(event, self, iteration, loss, metrics)

"""One ``fit()`` on one rank: the objects the loop works with -- the wrapped model, the data shards, the step, the
schedule, the resume cursor, the checkpointer, the stop agreement, the evaluator, the reports, the run folder --
made in the worker when the run opens (``Run.open``) and released when it closes. A Run is never pickled: what
crosses processes (the user's objects, config, callbacks, counters, metrics, the stop state) is the Trainer's."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .._common import envvars as envvars
from .._common import jobevents as jobevents
from .._common.choices import SHARDING
from .._runtime import compiling, inplace, watchdog
from .._runtime.preemption import GracefulStop, resolve_signals
from ..accelerator import retarget_optimizer, seed_everything
from ..callbacks import CallbackManager, LRScheduler, ModelCheckpoint
from ..checkpoint import (
    Checkpointer,
    Restored,
    Store,
    Uploads,
    capture_rng,
    check_exportable,
    export_model,
    open_memory,
    restore_memory,
    step_of,
)
from ..data import batches_per_epoch, is_infinite, prepare_train
from ..errors import CheckpointError, ConfigError
from . import notes, runstore, throughput
from .evaluate import Evaluator, prepare_eval
from .live import hold_warnings
from .metrics import EpochSums
from .peers import NOTHING_TO_RESTORE, Held, Mark, agree, commit_points, holding, shard_of
from .progress import Stop
from .resume import EpochCursor, derived_seed
from .runfolder import Claim, RunFolder, check_same_experiment, record_config, run_identity
from .schedule import NEVER, Schedule
from .shrink import keep_global_batch
from .steps import (
    AMP_DTYPES,
    SeededStep,
    Step,
    autocast_precision,
    is_custom_step,
    make_step,
    track_optimizer_steps,
)
from .stopping import RunStops
from .tracker import Span, Tracker, banner_info
from .validation import Validator

if TYPE_CHECKING:
    from ..checkpoint import MemoryCheckpoints
    from ..config import TrainConfig
    from ..trainer import Trainer

__all__ = ["Run", "build_scheduler", "periodic_kept", "best_of",
           "outside_counters"]


def build_scheduler(factory: Any, optimizer: Any, total: int | None, interval: str) -> LRScheduler:
    """``scheduler=lambda optimizer, total_steps: ...``, called with the run's planned optimizer steps."""
    if total is None:
        raise ConfigError("scheduler=<function>(optimizer, total_steps) needs the run's length, but the training "
                          "loader has no length and max_steps is not set. HINT: set TrainConfig(max_steps=...).")
    built = factory(optimizer, total)
    if not hasattr(built, "step") or not hasattr(built, "state_dict"):
        raise ConfigError(f"scheduler=<function>(optimizer, total_steps) returned {type(built).__name__}, not a "
                          f"torch.optim.lr_scheduler. HINT: return e.g. torch.optim.lr_scheduler.LambdaLR(optimizer, "
                          f"...).")
    return LRScheduler(built, on="optimizer_step" if interval == "step" else "train_epoch_end")


def periodic_kept(cfg: TrainConfig, callbacks: list[Any]) -> int | None:
    """How many periodic checkpoints a run keeps: ``keep_last_checkpoints``, else 1 when a ``ModelCheckpoint``
    keeps the run's chosen files (qadence's ``SaveBestCheckpoint`` keeps qadence's rule: all), else all (None)."""
    from ..callbacks import SaveBestCheckpoint

    if cfg.keep_last_checkpoints is not None:
        return int(cfg.keep_last_checkpoints)
    chosen = any(isinstance(cb, ModelCheckpoint) and not isinstance(cb, SaveBestCheckpoint) for cb in callbacks)
    return 1 if chosen else None


class Run:
    """What one ``fit()`` holds on one rank. ``Run.open(trainer, claim, ...)`` builds it (device, shards, step,
    folder, checkpointer, resume, reports); the loop asks it; ``close`` releases it."""

    model: nn.Module  # the wrapped model (DDP, FSDP) the loop trains
    train_loader: Any
    val_loader: Any
    per_epoch: int | None  # batches per epoch (None: until the loader ends)
    capped: bool  # stop after per_epoch batches even if the loader has more
    step: Step
    validator: Validator
    stopper: GracefulStop
    folder: RunFolder
    path: Path  # the run folder
    checkpointer: Checkpointer
    cursor: EpochCursor
    tracker: Tracker
    schedule: Schedule
    run_id: str | None
    memory: MemoryCheckpoints | None = None  # memory checkpoints (memory_checkpoint_every_n_steps)
    store: Store | None = None  # the checkpoint store (checkpoint_store) and rank 0's uploads to it
    uploads: Uploads | None = None
    compile_cache: Path | None = None
    peak_source: str = ""

    def __init__(self, trainer: Trainer, identity: dict[str, Any]) -> None:
        self.trainer, self.identity = trainer, identity
        self.progress = trainer.progress  # the one position (epoch, step, batch) and stop: the Trainer's, advanced here
        self.accelerator, self.config = trainer.accelerator, trainer.config
        self.running = False
        self.run_start = self.run_start_step = 0  # where this run (not this fit) started: checkpoints record it
        self.first_epoch = self.first_step = 0  # where this fit() started (the summary, the first-step note)
        self.last_epoch, self.last_step = 0, NEVER
        self.started = time.monotonic()
        self.failed = False  # how the run ended, for the releases that depend on it (memory, uploads)
        self.releases = contextlib.ExitStack()  # what _open took, released in reverse by close()
        self.cursor = EpochCursor()
        self.run_id = None
        self.stops = RunStops(self)  # how it stops before its epochs are done
        self.marking = inplace.enabled(self.accelerator)  # restarts in place: every complete step is marked
        self.mark: Mark | None = None

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, trainer: Trainer, claim: Claim, fire: Callable[..., None],
             parts: Callable[[Run | None], dict[str, Any]]) -> Run:
        """Everything one run needs on this rank. ``claim``: the folder the launching process claimed (or None);
        ``fire``: the Trainer's callback dispatch for the evaluator's batches; ``parts``: what a checkpoint of this
        run holds, by name. A failure on the way releases what was taken."""
        run = cls(trainer, claim.identity or run_identity(trainer.config, trainer.optimizer))  # before an lr change
        run.parts = lambda: parts(run)
        try:
            run._open(claim, fire)
        except BaseException:
            run.close()
            raise
        return run

    def _open(self, claim: Claim, fire: Callable[..., None]) -> None:
        trainer, acc, cfg = self.trainer, self.accelerator, self.config
        acc.setup()
        self.running = True
        self.config = cfg = keep_global_batch(cfg, acc.world_size, os.environ.get(envvars.PLANNED_WORLD),
                                              trainer.use_grad and not is_custom_step(trainer.optimize_step),
                                              trainer.console_print)
        if cfg.seed is not None:
            seed_everything(cfg.seed + acc.rank)
        self._prepare(fire)
        self.stopper = GracefulStop(resolve_signals(cfg.stop_signals),
                                    cfg.stop_file or os.environ.get(envvars.STOP_FILE), interrupt=True,
                                    announce=acc.is_main_process)
        self.stopper.install()
        self.releases.callback(self.stopper.restore)
        self.folder = RunFolder(cfg, self.identity, trainer.console_print)
        self.path = self.folder.agree(acc, claim.path, claim.continuing)
        self.releases.callback(self.folder.release)
        sharded = cfg.checkpoint_format == "sharded" or cfg.checkpoint_format == "auto" and cfg.strategy in SHARDING
        check_exportable(cfg.export_final_model, trainer.model)
        kept = periodic_kept(cfg, trainer.callbacks.callbacks)
        self.store, self.uploads = runstore.open_store(cfg, self.path, acc.is_main_process, kept,
                                                       trainer.console_print, acc.world_size)
        if self.uploads is not None:  # the newest committed checkpoint reaches the store, even after a failure
            self.releases.callback(lambda up: runstore.finish_uploads(up, self.failed, trainer.console_print),
                                   self.uploads)
        self.checkpointer = Checkpointer(self.path, kept, acc.is_main_process, sharded, cfg.async_checkpoint,
                                         self.uploads)
        if Schedule.memory_every(cfg):
            self.memory = open_memory(self.path, acc.rank, acc.world_size, self.model, trainer.optimizer,
                                      self.folder.run_id or "")
            for line in self.memory.stale_removed if acc.is_main_process else []:
                trainer.console_print(f"trainstack: {line}")
            if acc.is_main_process:
                self.memory.say = trainer.console_print
            self.releases.callback(lambda memory: memory.close(finished=not self.failed), self.memory)
        if self.marking:
            commit_points(trainer.optimizer, self.model, cfg.mixed_precision, self.releases)
        watchdog.start(acc.rank, acc.world_size, watchdog.resolve_timeout(cfg.hang_timeout), self.path,
                       watchdog.default_store(), armed=True)
        self.releases.callback(watchdog.stop)
        if acc.compile_options is not None:  # the first step compiles: a long window, the run's own cache
            self.compile_cache = compiling.use_cache(compiling.cache_folder(self.path, self.folder.run_id))
            watchdog.first_step_window(compiling.window())
            self.step = compiling.FirstStep(self.step, acc, trainer.console_print)
        self._start_reports(self._resume(claim.continuing is not None, claim.held))

    parts: Callable[[], dict[str, Any]]

    def _prepare(self, fire: Callable[..., None]) -> None:
        """The model on this rank's device (wrapped), the optimizer following it, the data shards, the step."""
        trainer, acc, cfg = self.trainer, self.accelerator, self.config
        moved: dict[int, nn.Parameter] = {}
        self.model = acc.prepare_model(trainer.model, moved)
        if trainer.use_grad:
            retarget_optimizer(trainer.optimizer, moved)
        if trainer.scheduler is not None:
            track_optimizer_steps(trainer.optimizer)
        layout = acc.layout  # the ranks of a tensor-parallel group read the same batches
        rank, world = layout.data_rank(acc.rank), layout.data_world
        self.train_loader = prepare_train(trainer.train_dataloader, rank, world, cfg.seed or 0, acc.pin_memory)
        self.val_loader = prepare_eval(trainer.val_dataloader, rank, world)
        self.per_epoch = batches_per_epoch(self.train_loader, trainer.max_batches)
        self.capped = bool(trainer.max_batches) or is_infinite(self.train_loader)
        self.step = make_step(cfg, trainer.optimizer, trainer.loss_fn, trainer.optimize_step, trainer.use_grad,
                              acc.device, acc.data_dtype)
        if cfg.seed_every_step and cfg.seed is not None:
            self.step = SeededStep(self.step, cfg.seed, acc.rank, lambda: self.progress.step)
        self.validator = Validator(self, Evaluator(acc, trainer.loss_fn, fire,
                                                   AMP_DTYPES.get(autocast_precision(cfg))))

    def _resume(self, continues: bool, held: Held | None = None) -> Restored | None:
        """Continue from a checkpoint when asked (before the banner, so it shows where training continues), and say
        what this run is: new, continued, or with nothing left to train."""
        trainer, cfg = self.trainer, self.config
        restored = None
        self.run_start, self.run_start_step = self.progress.epoch, self.progress.step
        main = self.accelerator.is_main_process
        if cfg.resume is not None:
            ours = self.identity
            if main:  # a recovery's phases (trainstack status --attempts): the restore starts, ends, trains
                jobevents.record("restoring")
            check = lambda state, where: check_same_experiment(state.get("identity"), ours, where)  # noqa: E731
            if cfg.resume == "auto" and self.store is not None:
                runstore.pull_newer(self.store, self.checkpointer, main, trainer.console_print,
                                    self.uploads.lease if self.uploads is not None else None)
                self.accelerator.barrier()  # every rank then sees what rank 0 downloaded
            restored = self._from_peers(held) if inplace.in_place_step() else None
            if restored is None and self.memory is not None:
                restored = self._from_memory(check)
            if restored is None:
                restored = self.checkpointer.restore(self.parts(), None if cfg.resume == "auto" else cfg.resume,
                                                     rank=self.accelerator.rank, check=check)
            if restored is None and held is not None and held.state is not None:
                raise CheckpointError(NOTHING_TO_RESTORE.format(rank=self.accelerator.rank))
            if restored is not None:
                self.apply(restored)
                if main:
                    jobevents.record("resumed", step=self.progress.step, source=restored.source or
                                     str(restored.path), origin=restored.origin, memory=restored.origin == "memory")
        if self.memory is not None:  # after every rank's restore: what an abandoned attempt saved later goes
            self.memory.forget_after(self.progress.step)
        self.last_epoch = self.run_start + cfg.max_iter
        self.last_step = self.run_start_step + cfg.max_steps if cfg.max_steps else NEVER
        self.first_step, self.first_epoch = self.progress.step, self.progress.epoch
        earlier = self.folder.earlier_run(self.path) if restored is None and not continues else None
        for note in notes.resume_notes(cfg, self.path, restored is not None, continues, self.progress.epoch,
                                       self.last_epoch, self.progress.step, self.last_step,
                                       trainer.stop_reason if restored is not None and trainer.stop_training else None,
                                       earlier) + ([notes.UNBOUNDED_LOADER] if self.per_epoch is None else []):
            trainer.console_print(note)
        return restored

    def _from_peers(self, held: Held | None) -> Restored | None:
        """Collective: the newest step a rank continued in place holds, taken from it by every rank holding another
        (no checkpoint read, no step redone); None: none holds one (said)."""
        acc = self.accelerator
        restored, why = agree(held, self.parts(), acc.rank, acc.world_size, shard_of(acc.layout, acc.rank))
        if restored is None:
            self.trainer.console_print(f"trainstack: {why}: resuming from the newest checkpoint.")
        return restored

    def _from_memory(self, check: Callable[[Any, Path], None]) -> Restored | None:
        """The newest complete memory set newer than the durable checkpoint (collective); None: the durable one
        (the copies passed over said, on rank 0)."""
        assert self.memory is not None
        newest = self.checkpointer.latest()
        durable = step_of(newest) if newest is not None else -1
        restored, passed_over = restore_memory(self.memory, self.parts(), durable, self.accelerator.world_size, check)
        if restored is not None and passed_over:
            self.trainer.console_print(f"trainstack: memory checkpoints passed over: {'; '.join(passed_over)}; the "
                                       f"next source was used.")
        elif restored is None and (passed_over or newest is not None):
            why = f": {'; '.join(passed_over)}" if passed_over else ""
            than, where = (" newer than the durable checkpoint", f"the durable checkpoint {newest.name}") \
                if newest is not None else ("", "the start")
            self.trainer.console_print(f"trainstack: no complete memory checkpoint set{than}{why}; resuming from "
                                       f"{where}.")
        return restored

    def save_memory(self, due: set[str]) -> None:
        """A memory checkpoint of this step when ``due`` (every rank): staged here, written and copied by its own
        thread; the time training waited goes to the live lines."""
        if "memory" not in due or self.memory is None:
            return
        start = time.perf_counter()
        with watchdog.phase("checkpoint"):
            self.memory.save(self.progress.step, self.memory.state(self.counters(), self.parts()))
        self.tracker.live.memory_stall += time.perf_counter() - start
        self.tracker.live.memory_failures = (self.memory.failed_rounds, self.memory.rounds)

    def _start_reports(self, restored: Restored | None) -> None:
        """Rank 0's reports (banner, bar or live lines, metrics files) and the schedule of step duties."""
        trainer, acc, cfg = self.trainer, self.accelerator, self.config
        span = self.span(cfg.gradient_accumulation_steps)
        found = restored.counters.get("run_id") if restored else None
        run_id = self.folder.adopt(found, self.path) if found and acc.is_main_process else self.folder.run_id
        self.run_id = acc.broadcast(run_id) if acc.world_size > 1 else run_id
        if self.memory is not None and self.run_id:  # a run that adopted its checkpoint's id writes under it
            self.memory.bind(self.run_id)
        self.tracker = Tracker(cfg, self.path, acc.is_main_process, span, clock=lambda: self.progress.step,
                               keep_through=int(restored.counters["global_step"]) if restored else None,
                               run_id=self.run_id, samples_per_batch=getattr(trainer.train_dataloader, "batch_size",
                                                                             None), world_size=acc.world_size)
        self.tracker.live.total_steps = span.total_steps
        self.step, self.peak_source = throughput.measured(
            self.step, self.tracker.live, trainer.optimizer, trainer.loss_fn, is_custom_step(trainer.optimize_step),
            acc.device, cfg.mixed_precision, acc.compile_options is not None, cfg.gradient_accumulation_steps,
            acc.world_size, acc.is_main_process, lambda: self.progress.step, self._plain_step,
            self._first_step if restored is not None else None)
        self.releases.callback(self.tracker.close)
        if not acc.is_main_process and self.tracker.bar_on():  # a bar on rank 0: the others' warnings wait
            self.releases.callback(hold_warnings(acc.rank))
        nothing_to_train = restored is not None and (trainer.stop_training or self.progress.step >= self.last_step
                                                     or self.progress.epoch >= self.last_epoch)
        if acc.is_main_process and not nothing_to_train:  # a no-op re-run leaves the record of what trained
            record_config(trainer.config, self.path)  # as planned: a shrink is said, not recorded
        self.schedule = Schedule.of_run(cfg, self.tracker.periods(), self.val_loader is not None,
                                        trainer.callbacks.period("optimizer_step"),
                                        notes.UNBOUNDED_REPORT if self.per_epoch is None else 0, self.last_step)
        self.schedule.start(self.progress.step)
        self.tracker.start(banner_info(self, span, watchdog.resolve_timeout(cfg.hang_timeout)))
        self.started = time.monotonic()

    def _plain_step(self, step: Step) -> None:
        self.step = step

    def _first_step(self) -> None:
        """A resumed run's first step is done: the end of a recovery (trainstack status --attempts)."""
        jobevents.record("first_step", step=self.progress.step + 1)

    # ------------------------------------------------------------------ where the run goes
    def span(self, accumulation: int) -> Span:
        """How far this run goes from where it starts (a resumed run: from its checkpoint's position)."""
        batches = self.per_epoch
        per_epoch = None if batches is None else math.ceil(batches / accumulation)
        by_epochs = None
        if per_epoch is not None:
            done = math.ceil(self.cursor.batch / accumulation)
            by_epochs = self.progress.step + max((self.last_epoch - self.progress.epoch) * per_epoch - done, 0)
        capped = self.last_step != NEVER and (by_epochs is None or self.last_step < by_epochs)
        total = self.last_step if capped else by_epochs
        return Span(self.progress.epoch, self.last_epoch, self.progress.step, total, per_epoch, batches, capped)

    def apply(self, restored: Restored) -> None:
        """Take over a checkpoint's counters; a mid-epoch one continues at its batch with its partial sums."""
        trainer, c, acc = self.trainer, restored.counters, self.accelerator
        self.progress.restore(c)
        self.run_start, self.run_start_step = int(c.get("run_start_epoch", 0)), int(c.get("run_start_step", 0))
        self.validator.last_step = int(c.get("val_step", -1))
        self.identity = c.get("identity") or self.identity
        if c.get("stopped_by"):  # the run ended by its own stop: nothing to train (resume_notes says so)
            self.progress.ask(Stop.REQUESTED, str(c["stopped_by"]))
        loader = self.train_loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.progress.epoch)
        persistent = bool(getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0))
        where = self.cursor.resume(restored, acc.world_size, getattr(loader, "samples_per_step", None),
                                   derived_seed(self.config.seed or 0, acc.rank, self.progress.step), persistent)
        trainer.console_print(f"Resumed from {restored.source or restored.path} (epoch {self.progress.epoch}, step "
                              f"{self.progress.step}{where}).")

    def epoch_means(self, sums: EpochSums, n: int) -> dict[str, Any]:
        """The epoch's ``train_*`` means over its ``n`` batches (over every rank with ``all_reduce_metrics``)."""
        reduce = self.accelerator.all_reduce_dict if self.config.all_reduce_metrics else None
        return sums.means("train", n, reduce)

    def log_line(self, n: int, sums: EpochSums, row: bool) -> None:
        """The live line (rank 0) and, with ``row``, the metrics row: the epoch so far, ``n`` batches in."""
        trainer = self.trainer
        position = self.tracker.position(self.progress.epoch, n)
        self.tracker.step_line((self.progress.epoch, self.progress.step, position), sums, n,
                               trainer.optimizer if trainer.use_grad else None, trainer.log_values,
                               self.accelerator.all_reduce_dict if row else None, row)

    # ------------------------------------------------------------------ what a checkpoint records
    def counters(self, partial: dict[str, Any] | None = None) -> dict[str, Any]:
        """The loop's own state in a checkpoint (``partial``: its position in the epoch, else the cursor's); the
        parts (model, optimizer, ...) save themselves."""
        found = self.best() or {}
        return {"epoch": self.progress.epoch, "global_step": self.progress.step,
                "global_batch": self.progress.batch, "run_start_epoch": self.run_start,
                "run_start_step": self.run_start_step, "val_step": self.validator.last_step,
                "partial_epoch": self.cursor.checkpoint() if partial is None else partial, "best": found or None,
                "best_val_loss": found["value"] if found.get("name") == "val_loss" else None,
                "saved_at": time.time(), "identity": self.identity, "run_id": self.run_id,
                "stopped_by": self.progress.stopped_by()}

    def completed(self, n: int, sums: EpochSums) -> None:
        """Optimizer step ``global_step`` is complete (its optimizer and scheduler stepped, after ``n`` batches of
        the epoch): where a rank restarted in place continues from, with no step redone (``peers``)."""
        if self.marking:
            acc = self.accelerator
            at = self.cursor.position(n, getattr(self.train_loader, "samples_per_step", None), acc.world_size)
            partial = {**at, "loss_sum": sums.loss_sum, "sums": dict(sums.sums), "interval": None}
            rng = None if self.config.seed_every_step else capture_rng()  # ~65 us; derived when seeded per step
            self.mark = Mark(self.progress.step, self.counters(partial), rng, acc.world_size)

    def held(self) -> Held:
        """What this rank holds as it leaves its failed group to continue in place (``peers.holding``)."""
        return holding(self.mark, self.progress.step, self.model, self.parts(), shard_of(self.accelerator.layout,
                                                                                      self.accelerator.rank))

    def finish(self) -> None:
        """The end of a finished run (every rank): the final checkpoint, the user's ``train_end`` callbacks and
        reports, the final model exported when asked, then the summary (rank 0): its steps, time, throughput, best
        and final values."""
        trainer, epoch = self.trainer, self.progress.epoch
        self.tracker.live.stop()  # the steps are done: the summary's throughput ends here
        if self.schedule.periodic_checkpoints and self.config.checkpoint_final:
            trainer.save_checkpoint()
        trainer.callbacks.fire("train_end", trainer, epoch)
        with watchdog.phase("callback"):
            self.tracker.train_end(epoch, trainer.model)
        if self.config.export_final_model:
            start, folder = time.perf_counter(), self.path / "export"
            files = export_model(self.model, folder, self.config.export_final_model, self.accelerator.is_main_process)
            if files:
                trainer.console_print(f"Exported the final model to {folder} ({self.config.export_final_model}: "
                                      f"{', '.join(f.name for f in files)}, {time.perf_counter() - start:.1f} s).")
        self.tracker.summary(time.monotonic() - self.started, (epoch, self.progress.step),
                             (self.first_epoch, self.first_step), self.best(), trainer.stop_reason, trainer.metrics)
        self.tracker.goodput()

    def best(self) -> dict[str, Any] | None:
        """The best monitored value of the first ``ModelCheckpoint`` that has one, with its file."""
        return best_of(self.trainer.callbacks, self.checkpointer)

    def close(self, failed: bool = False) -> None:
        """Release what the run took, in reverse (the watchdog, the tracker, the memory checkpoints, the last upload,
        the folder, the signal handlers); never raises over the error that ended the run (``failed``: rank 0
        records how far it got, for the steps a recovery lost)."""
        self.running, self.failed = False, failed
        if failed and self.accelerator.is_main_process:
            jobevents.record("failed", step=self.progress.step)
        self.releases.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a Run holds one process's handles (process group, files, signal handlers) and never "
                        "crosses processes")


def outside_counters(trainer: Trainer, checkpointer: Checkpointer, identity: dict[str, Any] | None
                     ) -> dict[str, Any]:
    """A checkpoint's counters written outside ``fit()`` (no run: no loop position)."""
    found = best_of(trainer.callbacks, checkpointer) or {}
    return {"epoch": trainer.current_epoch, "global_step": trainer.global_step, "global_batch": trainer.global_batch,
            "best": found or None, "saved_at": time.time(), "identity": identity,
            "stopped_by": trainer.progress.stopped_by()}


def best_of(callbacks: CallbackManager, checkpointer: Checkpointer | None) -> dict[str, Any] | None:
    """The best monitored value of the first ``ModelCheckpoint`` that has one, with its ``best`` file."""
    for cb in callbacks.callbacks:
        found = cb.best() if isinstance(cb, ModelCheckpoint) else None
        if found:
            path = checkpointer.named("best") if checkpointer is not None else None
            return {**found, "path": str(path) if path else None}
    return None

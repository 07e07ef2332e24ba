"""What one ``fit()`` holds on each rank, as functions of the Trainer so its class stays the loop: the set-up
(device, data shards, step, run folder, checkpointer, reports), the resume, the counters its checkpoints record,
the graceful and diverged stops, and the teardown."""

from __future__ import annotations

import os
import time
from typing import Any

from torch import nn

from .. import _envvars as envvars
from .. import _jobevents as jobevents
from .._runtime import compiling, watchdog
from .._runtime.preemption import INTERRUPT, GracefulStop, resolve_signals
from ..accelerator import retarget_optimizer, seed_everything
from ..callbacks import CallbackManager, LRScheduler, ModelCheckpoint
from ..checkpoint import Checkpointer, Restored
from ..data import batches_per_epoch, is_infinite, prepare_train
from ..errors import ConfigError
from . import notes, throughput
from .evaluate import Evaluator, prepare_eval
from .handoff import DIVERGED, INTERRUPTED, PREEMPTED
from .live import hold_warnings
from .resume import EpochCursor, derived_seed
from .runfolder import RunFolder, check_same_experiment, record_config, run_identity, standalone_checkpointer
from .schedule import NEVER, Schedule
from .steps import AMP_DTYPES, autocast_precision, make_step, track_optimizer_steps
from .tracker import Tracker, banner_info, run_span


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


def check_validation(cfg: Any, loader: Any) -> None:
    """Validation asked for without a loader is an error before any process starts."""
    if (cfg.val_every or cfg.val_every_n_steps) and loader is None:
        asked = f"val_every={cfg.val_every}" if cfg.val_every else f"val_every_n_steps={cfg.val_every_n_steps}"
        raise ConfigError(f"TrainConfig.{asked} but no validation DataLoader was given. HINT: "
                          f"fit(train_loader, val_loader) or Trainer(..., val_dataloader=...).")


def start(t: Any) -> None:
    """Everything one run needs on this rank: device, data shards, step, run folder, checkpoint, reports."""
    acc, cfg = t.accelerator, t.config
    acc.setup()
    t._running = True
    if cfg.seed is not None:
        seed_everything(cfg.seed + acc.rank)
    moved: dict[int, nn.Parameter] = {}
    t._ddp_model = acc.prepare_model(t.model, moved)
    if t.use_grad:
        retarget_optimizer(t.optimizer, moved)
    if t.scheduler is not None:
        track_optimizer_steps(t.optimizer)
    t._train_loader = prepare_train(t.train_dataloader, acc.rank, acc.world_size, cfg.seed or 0, acc.pin_memory)
    t._val_loader = prepare_eval(t.val_dataloader, acc.rank, acc.world_size)
    t._per_epoch = batches_per_epoch(t._train_loader, t.max_batches)
    t._capped = bool(t.max_batches) or is_infinite(t._train_loader)
    t.step = make_step(cfg, t.optimizer, t.loss_fn, t.optimize_step, t.use_grad, acc.device, acc.data_dtype)
    t.evaluate = Evaluator(acc, t.loss_fn, t._fire_batch, AMP_DTYPES.get(autocast_precision(cfg)))
    t.stopper = GracefulStop(resolve_signals(cfg.stop_signals), cfg.stop_file or os.environ.get(envvars.STOP_FILE),
                             interrupt=True, announce=acc.is_main_process)
    t.stopper.install()
    t._run_identity = t._run_identity or run_identity(cfg, t.optimizer)  # before any learning-rate change
    t._folder = RunFolder(cfg, t._run_identity, t.console_print)
    t.run_folder = t._folder.agree(acc, t._claimed, t.run_folder if t._continues else None)
    sharded = cfg.checkpoint_format == "sharded" or cfg.checkpoint_format == "auto" and cfg.strategy == "fsdp"
    t.checkpointer = Checkpointer(t.run_folder, periodic_kept(cfg, t._user_callbacks()), acc.is_main_process,
                                  sharded, cfg.async_checkpoint)
    watchdog.start(acc.rank, acc.world_size, watchdog.resolve_timeout(cfg.hang_timeout), t.run_folder,
                   watchdog.default_store(), armed=True)
    if acc.compile_options is not None:  # the first step compiles: a long window, the run's own cache
        t.compile_cache = compiling.use_cache(compiling.cache_folder(t.run_folder, t._folder.run_id))
        watchdog.first_step_window(compiling.window())
        t.step = compiling.FirstStep(t.step, acc, t.console_print)
    t.callbacks = CallbackManager(t._user_callbacks(), acc.is_main_process)
    start_reports(t, resume(t))


def periodic_kept(cfg: Any, callbacks: list[Any]) -> int | None:
    """How many periodic checkpoints a run keeps: ``keep_last_checkpoints``, else 1 when a ``ModelCheckpoint``
    keeps the run's chosen files (qadence's ``SaveBestCheckpoint`` keeps qadence's rule: all), else all (None)."""
    from ..callbacks import SaveBestCheckpoint

    if cfg.keep_last_checkpoints is not None:
        return int(cfg.keep_last_checkpoints)
    chosen = any(isinstance(cb, ModelCheckpoint) and not isinstance(cb, SaveBestCheckpoint) for cb in callbacks)
    return 1 if chosen else None


def resume(t: Any) -> Restored | None:
    """Continue from a checkpoint when asked (before the banner, so it shows where training continues), and say
    what this run is: new, continued, or with nothing left to train."""
    cfg = t.config
    t.cursor, restored = EpochCursor(), None
    t._run_start, t._run_start_step, t._val_step = t.current_epoch, t.global_step, -1
    if cfg.resume is not None:
        ours = t._run_identity
        restored = t.checkpointer.restore(t._parts(), None if cfg.resume == "auto" else cfg.resume,
                                          rank=t.accelerator.rank, check=lambda state, where: check_same_experiment(
                                              state.get("identity"), ours, where))
        if restored is not None:
            apply(t, restored)
    t._last_epoch = t._run_start + cfg.max_iter
    t._last_step = t._run_start_step + cfg.max_steps if cfg.max_steps else NEVER
    t._first_step, t._first_epoch = t.global_step, t.current_epoch
    for note in notes.resume_notes(cfg, t.run_folder, restored is not None, t._continues, t.current_epoch,
                                   t._last_epoch, t.global_step, t._last_step,
                                   t.stop_reason if restored is not None and t.stop_training else None) \
            + ([notes.UNBOUNDED_LOADER] if t._per_epoch is None else []):
        t.console_print(note)
    return restored


def start_reports(t: Any, restored: Restored | None) -> None:
    """Rank 0's reports (banner, bar or live lines, metrics files) and the schedule of step duties."""
    acc, cfg = t.accelerator, t.config
    span = run_span(t, cfg.gradient_accumulation_steps)
    found = restored.counters.get("run_id") if restored else None
    t.run_id = t._folder.adopt(found, t.run_folder) if found and acc.is_main_process else t._folder.run_id
    t.run_id = acc.broadcast(t.run_id) if acc.world_size > 1 else t.run_id
    t.tracker = Tracker(cfg, t.run_folder, acc.is_main_process, span, clock=lambda: t.global_step,
                        keep_through=int(restored.counters["global_step"]) if restored else None, run_id=t.run_id,
                        samples_per_batch=getattr(t.train_dataloader, "batch_size", None), world_size=acc.world_size)
    live = t.tracker.live
    live.peak, t._peak_source = throughput.peak_flops(acc.device, cfg.mixed_precision)
    live.total_steps = span.total_steps
    if acc.is_main_process:
        live.optimizer_timer = throughput.OptimizerTimer(t.optimizer, acc.device)
    if acc.is_main_process:  # FLOPs only where MFU shows (a peak, kernels not compiled: those hide them)
        t.step = throughput.FlopProbe(t.step, t, cfg.gradient_accumulation_steps,
                                      bool(live.peak) and acc.compile_options is None)
    t._held_warnings = hold_warnings(acc.rank) if not acc.is_main_process and t.tracker.bar_on() else None
    nothing_to_train = restored is not None and (t.stop_training or t.global_step >= t._last_step
                                                 or t.current_epoch >= t._last_epoch)
    if acc.is_main_process and not nothing_to_train:  # a no-op re-run leaves the record of what trained
        record_config(cfg, t.run_folder)
    t.schedule = Schedule({**t.tracker.periods(), "poll": cfg.stop_check_every,
                           "val": cfg.val_every_n_steps if t._val_loader is not None else 0,
                           "checkpoint": cfg.checkpoint_every_n_steps,
                           "optimizer_step": t.callbacks.period("optimizer_step"),
                           "report": notes.UNBOUNDED_REPORT if t._per_epoch is None else 0}, t._last_step)
    t.schedule.start(t.global_step)
    t.tracker.start(banner_info(t, span, watchdog.resolve_timeout(cfg.hang_timeout)))
    t._started = time.monotonic()


def close(t: Any) -> None:
    """Release what the run holds; never raises over the error that ended the run."""
    t._running = False
    watchdog.stop()
    if getattr(t, "stopper", None) is not None:
        t.stopper.restore()
    t.tracker.close()
    if getattr(t, "_held_warnings", None) is not None:
        t._held_warnings()
    folder = getattr(t, "_folder", None)
    if folder is not None:
        folder.release()


def outside_fit(t: Any) -> bool:
    """A checkpointer for a Trainer used outside ``fit()`` (see ``standalone_checkpointer``); True outside."""
    if getattr(t, "_running", False):
        return False
    t.run_folder, t.checkpointer = standalone_checkpointer(t.config, t.run_folder)
    return True


def stop_gracefully(t: Any, why: str) -> None:
    """A signal, the stop file or Ctrl-C: checkpoint (committed), tell the batch script, say how to resume."""
    kind = INTERRUPTED if why == INTERRUPT else PREEMPTED
    t.stop_training, t.stop_reason = True, f"{kind} ({why})"
    path = t.save_checkpoint()
    with watchdog.phase("checkpoint"):
        path = t.checkpointer.wait() or path  # an asynchronous save must be complete before the job ends
    if t.accelerator.is_main_process and kind == PREEMPTED:  # tells the batch script: requeue me
        t.stopper.confirm_saved(path or t.checkpointer.latest())
    line = notes.graceful_stop(kind, why, t.current_epoch, t.global_step, path, t.checkpointer.last_save_seconds,
                               t.run_folder)
    t.tracker.print(line)
    if t.accelerator.is_main_process:
        jobevents.record("graceful_stop", stop=kind, why=why, step=t.global_step, line=line.split(". ")[0])


def stop_diverged(t: Any) -> None:
    """A non-finite loss on any rank: stop before saving, so the last finite checkpoint survives rotation."""
    reason = notes.diverged_reason(t.metrics.get("train_loss"), t.current_epoch, t.checkpointer.latest())
    t.stop_training, t.stop_reason = True, f"{DIVERGED}: {reason}"
    t.tracker.print(f"trainstack: {reason}")


# ---------------------------------------------------------------------- what a checkpoint records
def counters(t: Any) -> dict[str, Any]:
    """The loop's own state in a checkpoint; the parts (model, optimizer, ...) save themselves."""
    found = best(t) or {}
    return {"epoch": t.current_epoch, "global_step": t.global_step, "global_batch": t.global_batch,
            "run_start_epoch": t._run_start, "run_start_step": t._run_start_step,
            "val_step": t._val_step, "partial_epoch": t.cursor.checkpoint(),
            "best": found or None, "best_val_loss": found["value"] if found.get("name") == "val_loss" else None,
            "saved_at": time.time(), "identity": t._run_identity, "run_id": t.run_id,
            "stopped_by": stopped_by(t.stop_training, t.stop_reason)}


def stopped_by(stopping: bool, reason: str) -> str | None:
    """A stop that ends the run for good (EarlyStopping, a trainstop criterion, ``request_stop``), as checkpoints
    record it: a resume has nothing left to train. A preemption, a Ctrl-C or the step limit are not such a stop."""
    if not stopping or not reason or reason.startswith((PREEMPTED, INTERRUPTED, DIVERGED, "max_steps=")):
        return None
    return reason


def best(t: Any) -> dict[str, Any] | None:
    """The best monitored value of the first ``ModelCheckpoint`` that has one, with its file."""
    for cb in t.callbacks.callbacks:
        found = cb.best() if isinstance(cb, ModelCheckpoint) else None
        if found:
            checkpointer = getattr(t, "checkpointer", None)
            path = checkpointer.named("best") if checkpointer is not None else None
            return {**found, "path": str(path) if path else None}
    return None


def apply(t: Any, restored: Restored) -> None:
    """Take over a checkpoint's counters; a mid-epoch one continues at its batch with its partial sums."""
    c, acc = restored.counters, t.accelerator
    t.current_epoch, t.global_step = int(c["epoch"]), int(c["global_step"])
    t.global_batch = int(c.get("global_batch", t.global_step))  # older checkpoints counted batches only
    t._run_start, t._run_start_step = int(c.get("run_start_epoch", 0)), int(c.get("run_start_step", 0))
    t._val_step = int(c.get("val_step", -1))
    t._run_identity = c.get("identity") or t._run_identity
    if c.get("stopped_by"):  # the run ended by its own stop: nothing to train (resume_notes says so)
        t.stop_training, t.stop_reason = True, str(c["stopped_by"])
    if hasattr(t._train_loader, "set_epoch"):
        t._train_loader.set_epoch(t.current_epoch)
    loader = t._train_loader
    persistent = bool(getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0))
    where = t.cursor.resume(restored, acc.world_size, getattr(loader, "samples_per_step", None),
                            derived_seed(t.config.seed or 0, acc.rank, t.global_step), persistent)
    t.console_print(f"Resumed from {restored.path} (epoch {t.current_epoch}, step {t.global_step}{where}).")

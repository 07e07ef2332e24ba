"""What a run reports, on rank 0 only: the banner, live lines or the progress bar, epoch lines, metrics.jsonl (plus
TensorBoard or MLflow), plots, hyperparameters, the model, the loss curve and the end-of-run summary.

The loop calls it by name at its moments (``step_line`` and ``bar_update`` when the schedule says so,
``epoch_end``, ``train_end``, ``close``); every other rank gets one that only takes part in the reductions of
logged values. ``.item()`` (a host sync) happens only here, when a line is printed or a row written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._common import envvars as envvars
from .._common.files import read_jsonl
from .._common.goodput import format_ledger, ledger
from .._common.text import size as text_size
from .._runtime import watchdog
from .._runtime.compiling import window
from .._runtime.writers import NullWriter, Writers, format_metrics, make_writers
from ..data import DictDataLoader, is_infinite
from .live import LiveLog, ProgressBar, banner, format_line, progress_enabled, summary
from .losscurve import save_loss_curve
from .metrics import MetricLog
from .schedule import Clock
from .steps import is_custom_step

if TYPE_CHECKING:
    from ..config import TrainConfig
    from .run import Run

__all__ = ["Tracker", "Span", "banner_info"]

log = logging.getLogger(__name__)


@dataclass
class Span:
    """How far a run goes: epochs ``start_epoch..last_epoch``, optimizer steps up to ``total_steps`` (None:
    unknown), ``steps_per_epoch`` (None: the loader has no length)."""

    start_epoch: int = 0
    last_epoch: int = 0
    start_step: int = 0
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    batches_per_epoch: int | None = None
    capped_by_steps: bool = False


class Tracker:
    """Rank 0's reports for one run folder, at the cadence ``config`` asks for."""

    def __init__(self, config: TrainConfig, folder: Path | None, is_main: bool, span: Span | None = None,
                 keep_through: int | None = None, clock: Any = None, samples_per_batch: int | None = None,
                 world_size: int = 1, run_id: str | None = None) -> None:
        self.config, self.is_main, self.folder = config, is_main, folder
        self.span = span or Span()
        self.writer: Writers = make_writers(config.tracking_tool, folder, keep_through, clock, run_id) \
            if is_main and folder is not None else NullWriter()
        self.bar = ProgressBar(self.span.total_steps, self.span.start_step, self.span.steps_per_epoch) \
            if is_main and progress_enabled(config.verbose) else None
        self.live = LiveLog(samples_per_batch, world_size, config.gradient_accumulation_steps)
        self.clock = Clock(config.log_every_seconds) if is_main and config.verbose and self.bar is None \
            and config.log_every_seconds else None
        self._extra = ""  # the last line's values after the loss, shown on the bar

    # -------------------------------------------------------------- periods for the loop's schedule
    def periods(self) -> dict[str, int]:
        """Step periods of this rank's reports: log lines (every rank: logged values may be reduced), the bar and the
        clock (rank 0)."""
        return {"log": self.config.log_every_n_steps, "bar": self.bar.every if self.bar else 0,
                "clock": 1 if self.clock else 0}

    def bar_on(self) -> bool:
        """Whether rank 0 shows a bar (every rank knows: it shares the terminal and the environment)."""
        return progress_enabled(self.config.verbose)

    def print(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def start(self, info: dict[str, Any]) -> None:
        self.live.restart(self.span.start_step)  # a resumed run's rates count from its own first step
        if self.is_main and self.config.verbose:
            print(banner(info), flush=True)
        if self.bar:
            self.bar.start()

    # -------------------------------------------------------------- while training
    def head(self, position: float, step: int) -> str:
        """``epoch 2.35/10 | step 150/400``: epochs are finished passes, as everywhere (checkpoint names, inspect,
        the end summary), with the fraction of the pass in progress; totals when known."""
        span = self.span
        epochs = "" if span.capped_by_steps else f"/{span.last_epoch}"
        steps = f"/{span.total_steps}" if span.total_steps else ""
        return f"epoch {epoch_text(position)}{epochs} | step {step}{steps}"

    def position(self, epoch: int, n: int) -> float:
        """Finished passes plus the fraction of the current one after its ``n``-th batch (0 when unknown)."""
        per = self.span.batches_per_epoch
        return epoch + (n / per if per else 0.0)

    def step_line(self, where: tuple[int, int, float], sums: Any, n: int, optimizer: Any, logged: MetricLog,
                  reduce: Any, row: bool) -> None:
        """A live line at ``where`` = (epoch, step, fractional epoch). ``row``: a line of the step count (every rank
        is here: logged values are collected, reduced over ranks, and written as a metrics.jsonl row); otherwise
        rank 0's clock asked for it (printed only)."""
        extra = logged.collect(reduce) if row else ({k: float(v) for k, v in logged.current().items()}
                                                   if self.is_main else {})
        if not self.is_main:
            return
        epoch, step, position = where
        values = {**self.live.values(sums, n, step, optimizer), **extra}
        if self.clock is not None:
            self.clock.lined()
        slow = watchdog.stragglers_now()  # rank 0's watchdog names them: no collective here
        if self.bar is not None:
            self._extra = format_line("", values).lstrip(" |") + (f" | {slow}" if slow else "")
        elif self.config.verbose:
            print(format_line(self.head(position, step), values) + (f" | {slow}" if slow else ""), flush=True)
        if row:
            self.writer.write(None, values, epoch=round(position, 4))

    def clock_due(self, step: int) -> tuple[bool, int]:
        """Rank 0's clock: ``(a time-based line is due, the next period)``."""
        assert self.clock is not None
        return self.clock.reading(step)

    def bar_update(self, epoch: int, step: int, n: int) -> None:
        """The bar moves on; its text shows the epoch and the last live line's values (one moment: a loss and a
        perplexity never from two different intervals; no host sync here)."""
        if self.bar is None:
            return
        self.bar.update(step, self.head(self.position(epoch, n), step) + (f" | {self._extra}" if self._extra else ""))

    def validation(self, position: float, step: int, values: dict[str, Any], row: bool = True) -> None:
        """A validation's line (when verbose) -- unless the epoch's metrics line shows it anyway -- and, inside an
        epoch, its metrics.jsonl row at its step (``row``; at an epoch's end the epoch's row holds it)."""
        if not self.is_main:
            return
        cfg = self.config
        shown = not row and cfg.print_every and int(position) % cfg.print_every == 0
        if cfg.verbose and not shown:
            line = format_line(self.head(position, step), values)
            self.bar.progress.console.print(line) if self.bar else print(line, flush=True)
        if row:
            self.writer.write(None, values, epoch=round(position, 4))

    def epoch_end(self, epoch: int, metrics: dict[str, Any], model: Any, step: int) -> None:
        """A metrics line every ``print_every`` epochs, a row every ``write_every`` (default 1), plots."""
        if not self.is_main:
            return
        cfg = self.config
        if cfg.verbose and cfg.print_every and epoch % cfg.print_every == 0:
            line = format_metrics(epoch, metrics, step, None if self.span.capped_by_steps else self.span.last_epoch)
            self.bar.progress.console.print(line) if self.bar else print(line, flush=True)
        if metrics and epoch % (cfg.write_every or 1) == 0:
            self.writer.write(epoch, metrics, epoch=epoch)
        if cfg.plot_every and epoch % cfg.plot_every == 0:
            self.writer.plot(model, epoch, cfg.plotting_functions)
        if self.bar:
            self.bar.update(step)

    def train_end(self, epoch: int, model: Any) -> None:
        """The reports of a finished run: a last plot, the hyperparameters, the model (MLflow)."""
        if not self.is_main:
            return
        cfg = self.config
        if cfg.plot_every:
            self.writer.plot(model, epoch, cfg.plotting_functions)
        if cfg.hyperparams:
            self.writer.log_hyperparams(cfg.hyperparams)
        if cfg.log_model:
            self.writer.log_model(model)

    def summary(self, seconds: float, end: tuple[int, int], start: tuple[int, int], best: dict[str, Any] | None,
                reason: str, final: dict[str, Any] | None = None) -> None:
        """The end-of-run summary (after the bar is gone), with the final losses."""
        if not (self.is_main and self.config.verbose):
            return
        self._stop_bar()
        line = self.live.run_line(seconds, end[1] - start[1], end[1])
        print(summary(seconds, end, start, best, self.folder, reason, line, final), flush=True)

    def goodput(self) -> None:
        """In a job (rank 0): the goodput ledger so far -- the job folder's timeline and this step's time by phase --
        in the summary and as ``goodput/*`` values to metrics.jsonl and the trackers."""
        folder = os.environ.get(envvars.JOB_DIR)
        if not self.is_main or not folder:
            return
        watchdog.write_ledger()
        found = ledger(Path(folder))
        if found is None:
            return
        if self.config.verbose:
            print(f"  {format_ledger(found)}", flush=True)
        self.writer.write(None, {"goodput/percent": round(100 * found["goodput"], 2),
                                 **{f"goodput/{name}_s": sec for name, sec in found["parts"].items()}})

    def _stop_bar(self) -> None:
        if self.bar:
            self.bar.stop()
            self.bar = None

    def close(self) -> None:
        """Stop the bar and the optimizer timer, draw the loss curve, close the writers. Failures here are logged,
        never raised: they must not hide the error that ended the run."""
        self._stop_bar()
        if self.live.optimizer_timer is not None:
            self.live.optimizer_timer.close()  # the optimizer goes back without our hooks
        writer, self.writer = self.writer, NullWriter()
        if not self.is_main or self.folder is None:
            return
        try:
            rows = read_rows(self.folder / "metrics.jsonl") or writer.history
            if rows:
                save_loss_curve(rows, self.folder / "loss_curve.svg")
        except Exception as exc:  # e.g. a full disk: the checkpoint error the user needs came first
            log.warning("could not draw %s: %s", self.folder / "loss_curve.svg", exc)
        try:
            writer.close()
        except Exception as exc:
            log.warning("could not close the metric writers: %s", exc)


def epoch_text(position: float) -> str:
    """``3`` for a finished pass, ``2.35`` inside one."""
    return str(int(position)) if position == int(position) else f"{position:.2f}".rstrip("0")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl with a step (a whole resumed run's, not only this process's), numbers only."""
    return [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in read_jsonl(path, owner=None)
            if isinstance(row.get("step"), int)]  # a run folder's own file: read whatever the umask made it


def _parallelism(strategy: str, layout: Any, checkpointing: Any) -> str:
    """``hsdp: 2 replicas x 2 shards, activation checkpointing full`` -- what the run's mesh and wrapping are."""
    sizes = [f"{layout.replicate} replica(s)" if strategy in ("ddp", "hsdp") or layout.replicate > 1 else "",
             f"{layout.shard} shard(s)" if strategy in ("fsdp", "hsdp") else "",
             f"tensor parallel {layout.tp}" if layout.tp > 1 else ""]
    ac = checkpointing if isinstance(checkpointing, str) else "a function of yours" if checkpointing else None
    return f"{strategy}: {' x '.join(x for x in sizes if x) or 'one process'}" + \
        (f", activation checkpointing {ac}" if ac else "")


def banner_info(run: Run, span: Span, hang_timeout: float) -> dict[str, Any]:
    """What the start banner shows: the data, the processes, the batch sizes, the steps ahead, the folder."""
    trainer = run.trainer
    acc, cfg, loader = run.accelerator, run.config, trainer.train_dataloader
    per_proc = getattr(loader, "batch_size", None) or 1
    steps: Any = "unknown (the loader has no length)" if span.total_steps is None else \
        span.total_steps - span.start_step
    info: dict[str, Any] = {
        "Num examples": _num_examples(loader), "Num epochs": span.last_epoch - run.run_start,
        "Batches per epoch": span.batches_per_epoch if span.batches_per_epoch is not None else "until the loader ends",
        "Processes": f"{acc.world_size} ({acc.backend} on {acc.device.type})",
        "Batch size per process": per_proc,
        "Total batch size (w. parallel & accumulation)": per_proc * acc.world_size * cfg.gradient_accumulation_steps,
        "Gradient accumulation steps": cfg.gradient_accumulation_steps,
        "Total optimization steps": steps, "Model": model_summary(acc.unwrap_model(trainer.model)),
        "Parallelism": _parallelism(cfg.strategy, acc.layout, cfg.activation_checkpointing),
        "Run folder": run.path,
        "Hang watchdog": f"armed: {hang_timeout:g} s without progress (3x for the first step, checkpoints, "
                         f"callbacks)" if hang_timeout else "off"}
    if cfg.max_steps is not None:
        info["Max steps"] = cfg.max_steps
    keep = run.checkpointer.keep_last
    info["Checkpoints"] = ("best only (checkpoint_best_only)" if not run.schedule.periodic_checkpoints else
                           f"periodic ones rotated: the newest {keep} kept" if keep else "every periodic one kept") + \
        ("; a ModelCheckpoint keeps its own files" if any(type(cb).__name__ == "ModelCheckpoint"
                                                          for cb in trainer.callbacks.callbacks) else "")
    if run.memory is not None:
        memory = run.memory
        peer = f"each rank's copy also on a rank of the next node (rank 0's: {memory.nodes[memory.peers[0]]})" \
            if memory.peers[0] is not None else "one node: no copy on another node"
        info["Memory checkpoints"] = f"every {run.schedule.periods.get('memory', 0)} steps in {memory.folder}; {peer}"
    source = run.peak_source
    info["MFU"] = f"over the {source}" if run.tracker.live.peak else f"n/a: {source}" if source else "n/a"
    if acc.compile_options is not None:
        if run.tracker.live.peak and is_custom_step(trainer.optimize_step):
            info["MFU"] = "n/a: a compiled custom optimize_step's FLOPs are not counted"
        elif run.tracker.live.peak:
            info["MFU"] += " (the compiled model's FLOPs counted once on fake tensors)"
        info["Compile"] = (f"torch.compile({', '.join(f'{k}={v!r}' for k, v in acc.compile_options.items())}): "
                           f"compiling... (the first step may take {window():g} s on every rank); cache: "
                           f"{run.compile_cache or 'torch default'}")
    if is_infinite(run.train_loader) and not trainer.max_batches:
        info["Batches per epoch"] = "1 (an endless loader; set max_batches for more)"
    if trainer.current_epoch or trainer.global_step:
        info["Continuing at"] = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
    return info


def model_summary(model: Any) -> str:
    """``Net: 1,234,567 parameters (1,200,000 trainable), 4.9 MB float32`` -- what Lightning's model summary
    totals, in one line (sharded parameters count whole)."""
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    size = sum(p.numel() * p.element_size() for p in params)
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})) or "no parameters"
    return f"{type(model).__name__}: {total:,} parameters ({trainable:,} trainable), {text_size(size)} {dtypes}"


def _num_examples(loader: Any) -> Any:
    if isinstance(loader, DictDataLoader):
        return {k: _num_examples(v) for k, v in loader.dataloaders.items()}
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return "unknown"

"""What users see on rank 0 while training: the start banner, the progress bar (a terminal) or live log lines (a
Slurm log), and the end-of-run summary.

A live line reads ``epoch 2/10 | step 150/400 | loss 0.4123 | lr 1.00e-03 | 812 samples/s | <logged values>``:
the loss and the loss function's metrics averaged over the steps since the previous line (from the epoch's sums
on the device: fetched here in one transfer, the one host sync of a line), the learning rate of every param group,
and the throughput over the interval.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .._common import envvars as envvars
from .._common.text import duration, number

__all__ = ["ProgressBar", "LiveLog", "banner", "progress_enabled", "format_line", "summary", "hold_warnings", "timed",
           "DATA_BOUND"]


def progress_enabled(verbose: bool) -> bool:
    """Bar on when verbose and stdout is a terminal; TRAINSTACK_PROGRESS=1/0 forces it on/off."""
    forced = os.environ.get(envvars.PROGRESS)
    if forced is not None:
        return forced not in ("0", "false", "")
    return verbose and sys.stdout.isatty()


def banner(info: dict[str, Any]) -> str:
    width = max(len(k) for k in info)
    lines = ["***** Running training *****"] + [f"  {k:<{width}} = {v}" for k, v in info.items()]
    return "\n".join(lines)


def format_line(head: str, values: dict[str, float]) -> str:
    """``head | name value | ...`` with short numbers (learning rates in scientific notation)."""
    parts = [head]
    for name, value in values.items():
        if name in ("samples_per_s", "batches_per_s", "tokens_per_s"):
            parts.append(f"{value:,.0f} {name.replace('_per_s', '/s')}")
        elif name == "data_wait":
            parts.append(f"data {100 * value:.0f}%")
        elif name == "optimizer_share":
            parts.append(f"optim {100 * value:.0f}%")
        elif name == "memory_checkpoint_share":
            parts.append(f"mem-ckpt {100 * value:.1f}%")
        elif name == "mfu":
            parts.append(f"mfu {100 * value:.3g}%")
        elif name == "eta_s":
            parts.append(f"eta {duration(value)}")
        elif name == "max_mem_gb":
            parts.append(f"mem {value:.1f}G")
        elif name.startswith("lr"):
            parts.append(f"{name} {value:.2e}")
        else:
            parts.append(f"{name} {number(value)}")
    return " | ".join(parts)


class LiveLog:
    """Rank 0's view of the interval since the previous line: a snapshot of the epoch's sums (references to device
    tensors, no copy), the step and the time."""

    def __init__(self, samples_per_batch: int | None, world_size: int, accumulation: int) -> None:
        self.per_step = samples_per_batch * world_size * accumulation if samples_per_batch else None
        self.batches_per_step = world_size * accumulation
        self.flops_per_step: float | None = None  # one rank's, counted once (throughput.FlopProbe)
        self.tokens_per_step: int | None = None
        self.peak: float | None = None  # one device's peak FLOP/s: MFU only with it
        self.total_steps: int | None = None  # for the ETA
        self.data_wait = 0.0  # seconds this rank waited for the loader's next batch (timed())
        self.memory_stall = 0.0  # seconds training waited for memory checkpoints (Run.save_memory)
        self.memory_failures = (0, 0)  # memory checkpoint rounds failed, of those finished (Run.save_memory)
        self.optimizer_timer: Any = None  # seconds inside optimizer.step (throughput.OptimizerTimer), rank 0
        self._waited = self._optimized = self._stalled = 0.0
        self._warned = self._lined = False
        self._sums: Any = None
        self._loss: Any = None
        self._metrics: dict[str, Any] = {}
        self._n = 0
        self._step: float = 0
        self._time = time.monotonic()
        self._steady: tuple[float, float] | None = None  # (step, time) of the last restart: the run's steady part
        self._ended: float | None = None

    def restart(self, step: float) -> None:
        """The next interval's rates count from ``step`` and now (a run's start, a resumed one's, after the first
        step's warm-up and the FLOP-counted step): never the steps before this run, nor a compile, as throughput."""
        self._step, self._time = step, time.monotonic()
        self._steady = (step, self._time)
        self._waited, self._stalled = self.data_wait, self.memory_stall
        self._optimized = self.optimizer_timer.seconds() or 0.0 if self.optimizer_timer is not None else 0.0

    def epoch_start(self, sums: Any, n: int, interval: dict[str, Any] | None = None) -> None:
        """A new epoch (or the rest of a resumed one) starts: the interval counts its batches from ``n`` -- or, in a
        resumed epoch, from where the stopped run's open interval began (``interval``)."""
        self._sums, self._loss, self._metrics, self._n = sums, sums.loss_sum, dict(sums.sums), n
        if interval:
            self._loss, self._metrics, self._n = interval.get("loss"), dict(interval.get("metrics") or {}), \
                int(interval.get("n", n))

    def interval(self) -> dict[str, Any]:
        """Where the open log interval began (for a checkpoint): the epoch's sums then, and its batch."""
        return {"loss": self._loss, "metrics": dict(self._metrics), "n": self._n}

    def values(self, sums: Any, n: int, step: int, optimizer: Any) -> dict[str, float]:
        """The interval's loss and metric means, learning rates and throughput; starts the next interval."""
        now = time.monotonic()
        out: dict[str, float] = {}
        if sums is not self._sums:  # an epoch the trainer did not announce: from its start
            self._sums, self._loss, self._metrics, self._n = sums, None, {}, 0
        batches = n - self._n
        if batches > 0 and sums.loss_sum is not None:
            names = ["loss", *sums.sums]
            deltas = [sums.loss_sum - (self._loss if self._loss is not None else 0),
                      *(total - self._metrics.get(name, 0) for name, total in sums.sums.items())]
            out.update((name, value / batches) for name, value in zip(names, host_floats(deltas), strict=True))
        out.update(learning_rates(optimizer))
        seconds = max(now - self._time, 1e-9)
        if step > self._step:
            out.update(self._rates((step - self._step) / seconds, step))
            out["data_wait"] = min((self.data_wait - self._waited) / seconds, 1.0)
            self._loader_bound(out["data_wait"], first=not self._lined)
            self._lined = True
            if self.memory_stall:
                out["memory_checkpoint_share"] = min((self.memory_stall - self._stalled) / seconds, 1.0)
            if self.memory_failures[0]:
                out["memory_checkpoint_failures"] = float(self.memory_failures[0])
        optimized = self.optimizer_timer.seconds() if self.optimizer_timer is not None else None
        if step > self._step and optimized is not None:
            out["optimizer_share"] = min(max(optimized - self._optimized, 0.0) / seconds, 1.0)
        self._waited, self._optimized, self._stalled = self.data_wait, optimized or 0.0, self.memory_stall
        self._loss, self._metrics, self._n, self._step, self._time = sums.loss_sum, dict(sums.sums), n, step, now
        return out


    def stop(self) -> None:
        """The last step is done: the run's throughput ends here (the final checkpoint is not a step)."""
        self._ended = time.monotonic()

    def run_line(self, seconds: float, steps: int, last_step: int) -> str:
        """The run's throughput (its steady part: from after the warm-up and FLOP-counted steps to the last step's
        end, validations and checkpoints between included) and the whole run's step-time split, for the end summary
        (empty before a step): ``812 samples/s, mfu 41% | time: data wait 3%, optimizer 12%, the rest 85%``."""
        if seconds <= 0 or steps <= 0:
            return ""
        rate = steps / seconds
        if self._steady is not None and self._ended is not None and last_step > self._steady[0]:
            rate = (last_step - self._steady[0]) / max(self._ended - self._steady[1], 1e-9)
        rates = self._rates(rate, 0)
        rates.pop("eta_s", None), rates.pop("max_mem_gb", None)
        split = {"data wait": min(self.data_wait / seconds, 1.0)}
        optimized = self.optimizer_timer.seconds() if self.optimizer_timer is not None else None
        if optimized is not None:
            split["optimizer"] = min(max(optimized, 0.0) / seconds, 1.0 - split["data wait"])
        if self.memory_stall:
            split["memory checkpoints"] = min(self.memory_stall / seconds, max(1.0 - sum(split.values()), 0.0))
        split["forward/backward and the rest"] = 1.0 - sum(split.values())
        failed, rounds = self.memory_failures
        note = f" | memory checkpoints: {failed} of {rounds} failed" if failed else ""
        return format_line("", rates).lstrip(" |").replace(" | ", ", ") + " | time: " + \
            ", ".join(f"{name} {100 * share:.0f}%" for name, share in split.items()) + note

    def _rates(self, steps_per_s: float, step: int) -> dict[str, float]:
        """Samples (or batches) and tokens per second, MFU, the ETA to the last step, peak GPU memory."""
        out = {"samples_per_s": steps_per_s * self.per_step} if self.per_step else \
            {"batches_per_s": steps_per_s * self.batches_per_step}
        if self.tokens_per_step:
            out["tokens_per_s"] = steps_per_s * self.tokens_per_step
        if self.flops_per_step and self.peak and self.flops_per_step * steps_per_s <= self.peak:
            out["mfu"] = self.flops_per_step * steps_per_s / self.peak  # above the peak: a wrong peak, not shown
        if self.total_steps:
            out["eta_s"] = max(self.total_steps - step, 0) / steps_per_s
        if _cuda_in_use():
            import torch

            out["max_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return out


    def _loader_bound(self, share: float, first: bool) -> None:
        """Once per run: the training waits for data a large share of the time (not in the first interval, which
        holds the workers' start)."""
        if share > DATA_BOUND and not first and not self._warned:
            self._warned = True
            print(f"trainstack: training waits for the DataLoader {100 * share:.0f}% of the time: data loading is "
                  f"the bottleneck. HINT: more workers (DataLoader(num_workers=...), persistent_workers=True), "
                  f"pin_memory=True on GPUs, a larger prefetch_factor, or data prepared ahead of time.", flush=True)


#: The share of step time spent waiting for data above which the run is called loader-bound (warned once).
DATA_BOUND = 0.3


def timed(batches: Any, live: LiveLog) -> Any:
    """The batches, with the time spent waiting for each added to ``live.data_wait`` (two clock reads a batch, no
    device sync)."""
    clock, it = time.perf_counter, iter(batches)
    while True:
        start = clock()
        try:
            batch = next(it)
        except StopIteration:
            return
        live.data_wait += clock() - start
        yield batch


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def host_floats(values: list[Any]) -> list[float]:
    """Device scalars as Python floats in one transfer: one host sync per line, however many metrics it shows."""
    torch = sys.modules.get("torch")  # a tensor here means torch is imported; this module never imports it
    tensors = [v for v in values if torch is not None and isinstance(v, torch.Tensor)]
    if torch is None or len(tensors) < 2 or len({t.device for t in tensors}) > 1:
        return [float(v) for v in values]
    wide = torch.float32 if tensors[0].device.type == "mps" else torch.float64  # MPS has no float64
    fetched = iter(torch.stack([t.detach().reshape(()).to(wide) for t in tensors]).tolist())
    return [next(fetched) if isinstance(v, torch.Tensor) else float(v) for v in values]


def learning_rates(optimizer: Any) -> dict[str, float]:
    """``lr`` (one param group) or ``lr/group<i>`` for each group; nothing for optimizers without groups."""
    groups = getattr(optimizer, "param_groups", None) or []
    rates = [float(g["lr"]) for g in groups if "lr" in g]
    if len(rates) == 1:
        return {"lr": rates[0]}
    return {f"lr/group{i}": lr for i, lr in enumerate(rates)}


def summary(seconds: float, end: tuple[int, int], start: tuple[int, int], best: dict[str, Any] | None,
            folder: Any, reason: str, throughput: str = "", final: dict[str, Any] | None = None) -> str:
    """The end-of-run lines: how long, how far (``end``/``start`` are (epoch, step) at the end and at this run's
    start: a resumed run says where it ended and what it trained itself), why it ended, the best monitored value
    and where the files are."""
    took = time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds >= 60 else f"{seconds:.1f} s"
    epochs, steps = end[0] - start[0], end[1] - start[1]
    rate = f" ({steps / seconds:.2f} steps/s)" if seconds > 0 and steps else ""
    done = f"{epochs} epoch(s), {steps} step(s)"
    if start[1]:
        done = f"at epoch {end[0]}, step {end[1]} ({done} this run)"
    lines = [f"Training finished: {done} in {took}{rate}" + (f"; {reason}" if reason else ".")]
    shown = {k: float(v) for k, v in (final or {}).items() if k.startswith(("train_loss", "val_loss"))}
    if shown:
        lines.append("  final: " + format_line("", shown).lstrip(" |"))
    if throughput:
        lines.append(f"  throughput: {throughput}")
    if best and best.get("value") is not None:
        where = f": {best['path']}" if best.get("path") else ""
        lines.append(f"  best {best['name']} = {number(float(best['value']))} (step {best.get('step')}){where}")
    lines.append(f"  run folder: {folder}")
    return "\n".join(lines)


class ProgressBar:
    """A bar over the optimizer steps of the run, updated every ``every`` steps (~5 % of an epoch), never per step;
    its text shows the epoch and the values of the last live line (all from one moment)."""

    def __init__(self, total_steps: int | None, start_step: int, steps_per_epoch: int | None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.table import Column

        self.every = max((steps_per_epoch or 20) // 20, 1)
        # the bar, the count and the time left keep their room; a narrow terminal cuts the line's values instead
        fixed = len("training") + 24 + 2 * len(str(total_steps or 0)) + 1 + len("0:00:00") + 5
        room = max(Console().width - fixed, 10)
        self.progress = Progress(TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True)),
                                 BarColumn(bar_width=24), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[text]}", table_column=Column(
                                     no_wrap=True, overflow="ellipsis", max_width=room)), transient=False)
        self.task = self.progress.add_task("training", total=total_steps, completed=start_step, text="")

    def start(self) -> None:
        self.progress.start()

    def update(self, step: int, text: str | None = None) -> None:
        if text is None:
            self.progress.update(self.task, completed=step)
        else:
            self.progress.update(self.task, completed=step, text=text)

    def stop(self) -> None:
        self.progress.stop()


def hold_warnings(rank: int) -> Any:
    """On a rank other than 0 while rank 0 draws a bar on the shared terminal: Python warnings are kept (each once)
    instead of printed through the bar; the returned function prints them, marked with the rank, and restores
    the usual printing."""
    import warnings

    held: dict[str, None] = {}
    previous = warnings.showwarning

    def keep(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        held[f"{category.__name__}: {message} ({filename}:{lineno})"] = None

    warnings.showwarning = keep

    def release() -> None:
        warnings.showwarning = previous
        for text in held:
            print(f"[rank {rank}] warning during training: {text}", file=sys.stderr, flush=True)

    return release

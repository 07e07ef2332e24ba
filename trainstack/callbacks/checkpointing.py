"""Checkpoints chosen by a monitored value: ``ModelCheckpoint`` (Lightning's names) and qadence's
``SaveBestCheckpoint`` built on it.

Every rank runs them (a save is a collective); rank 0's value decides, so the ranks never disagree on whether to
save. The kept files are part of the callback's state, which every checkpoint holds: a resumed run knows them, and
removes the files a stopped run wrote after the checkpoint it resumes from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .base import Callback
from .builtin import METRIC_NAMES

__all__ = ["ModelCheckpoint", "SaveBestCheckpoint"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]+")
Criterion = Callable[[float, float, float], bool]


class ModelCheckpoint(Callback):
    """Keep the ``save_top_k`` best checkpoints by ``monitor`` (``mode`` ``"min"`` or ``"max"``), with ``best``
    (``best.pt``, or a ``best`` folder for sharded checkpoints) naming the best one; ``save_last`` also keeps
    ``last`` naming the newest state.

    When: every ``every_n_steps`` optimizer steps if given; otherwise after every validation, or at every epoch end
    (every ``every_n_epochs``) when the run does not validate. ``monitor`` is any metric the Trainer knows:
    ``val_<name>``/``train_<name>`` from the loss function, or a value given to ``trainer.log``; ``None`` keeps the
    newest ``save_top_k``. Files are named ``filename`` (default ``best-<monitor>-e<epoch>-s<step>``; ``{epoch}``,
    ``{step}`` and ``{value}`` are filled in). ``save_top_k=-1`` keeps all, ``0`` none (with ``save_last``).
    """

    def __init__(self, monitor: str | None = "val_loss", mode: str = "min", save_top_k: int = 1,
                 save_last: bool = False, every_n_steps: int | None = None, every_n_epochs: int = 1,
                 filename: str | None = None, min_delta: float = 0.0, criterion: Criterion | None = None,
                 **kwargs: Any) -> None:
        name = type(self).__name__
        if mode not in ("min", "max"):
            raise ConfigError(f"{name}(mode={mode!r}): must be 'min' or 'max'.")
        for field, value, low in (("save_top_k", save_top_k, -1), ("every_n_epochs", every_n_epochs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}({field}={value!r}): must be an integer >= {low}.")
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ConfigError(f"{name}(every_n_steps={every_n_steps!r}): must be an integer >= 1 or None.")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError(f"{name}(monitor={monitor!r}): must be a metric name or None.")
        if filename is not None and (not filename or "/" in filename or filename in ("last",) or
                                     filename.startswith(("ckpt-", "."))):
            raise ConfigError(f"{name}(filename={filename!r}): must be a plain file name (no '/', not starting with "
                              f"'ckpt-' or '.', not 'last').")
        kwargs.setdefault("on", "optimizer_step" if every_n_steps else "val_epoch_end")
        kwargs.setdefault("called_every", every_n_steps or 1)
        super().__init__(**kwargs)
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_steps, self.every_n_epochs, self.min_delta = every_n_steps, every_n_epochs, min_delta
        self.criterion = criterion
        self.filename = filename or (f"best-{_UNSAFE.sub('_', monitor)}-e{{epoch}}-s{{step}}" if monitor
                                     else "recent-e{epoch}-s{step}")
        self.kept: list[tuple[float, str, int, int]] = []  # (value, name, epoch, step), best first

    # -------------------------------------------------------------- when
    @property
    def events(self) -> tuple[str, ...]:
        if self.every_n_steps or self.on not in ("val_epoch_end", "train_epoch_end"):
            return (self.on,)
        return ("val_epoch_end", "train_epoch_end", "train_start")

    def __call__(self, when: str, trainer: Any, config: Any, writer: Any) -> Any:
        if when == "train_start":
            return self.tidy(trainer)
        if when not in self.events:
            return None
        run = getattr(trainer, "run", None)
        if when == "train_epoch_end" and (run is not None and run.schedule.validates
                                          or trainer.opt_result.iteration % self.every_n_epochs):
            return None  # a run that validates saves after its validations
        return super().__call__(when, trainer, config, writer)

    # -------------------------------------------------------------- what
    def run_callback(self, trainer: Any, config: Any, writer: Any) -> Any:
        """Save when the value enters the kept ones; returns the file written (None when it did not)."""
        value = self.value(trainer)
        epoch, step = int(trainer.current_epoch), int(trainer.global_step)
        if self.save_last:
            trainer.save_checkpoint()
            trainer.checkpointer.wait()  # an asynchronous save is linked to once complete
            newest = trainer.checkpointer.latest()
            if newest is not None:
                trainer.checkpointer.link(newest, "last")
        if self.save_top_k == 0 or value is None or not math.isfinite(value) or not self._enters(value):
            return None
        name = self.filename.format(epoch=f"{epoch:05d}", step=f"{step:09d}", value=f"{value:.6g}")
        kept = sorted([k for k in self.kept if k[1] != name] + [(value, name, epoch, step)], key=lambda k: k[0],
                      reverse=self.mode == "max")
        self.kept, dropped = (kept[:self.save_top_k], kept[self.save_top_k:]) if self.save_top_k > 0 else (kept, [])
        # the new state (this file among the kept ones) goes into the file itself: a resume from it knows it
        saved = trainer.save_checkpoint(name=name, monitor={"name": self.monitor or "step", "value": value,
                                                            "mode": self.mode})
        for _, old, _, _ in dropped:
            trainer.checkpointer.remove(old)  # a ghost (removed by a stopped run) is no error
        if self.kept[0][1] == name and name != "best":
            trainer.checkpointer.link(name, "best")
        return saved

    def value(self, trainer: Any) -> float | None:
        """The monitored value now (rank 0's, on every rank); the step when nothing is monitored."""
        if self.monitor is None:
            return float(trainer.global_step)
        metrics = dict(getattr(trainer, "callback_metrics", None) or trainer.opt_result.metrics)
        if self.monitor not in metrics:
            raise ConfigError(f"{type(self).__name__}: metric {self.monitor!r} not found; available: "
                              f"{sorted(metrics)}. HINT: {METRIC_NAMES}")
        value = float(metrics[self.monitor])
        return _rank0(trainer, value)

    def _enters(self, value: float) -> bool:
        """Better than the worst kept one (or room left)."""
        if self.save_top_k < 0 or len(self.kept) < self.save_top_k:
            return True
        worst = self.kept[-1][0]
        return self.better(value, worst)

    def better(self, value: float, than: float) -> bool:
        if self.criterion is not None:
            return bool(self.criterion(value, than, self.min_delta))
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def best(self) -> dict[str, Any] | None:
        """The best kept checkpoint: name, value, mode, epoch, step, file (what checkpoints and the summary show)."""
        if not self.kept or self.monitor is None:
            return None
        value, name, epoch, step = self.kept[0]
        return {"name": self.monitor, "value": value, "mode": self.mode, "epoch": epoch, "step": step,
                "checkpoint": name}

    # -------------------------------------------------------------- files after a resume
    def tidy(self, trainer: Any) -> None:
        """Rank 0 at the start of a run: remove files of this callback that its state does not know (written after
        the checkpoint this run resumed from), and point ``best`` at the best kept one."""
        checkpointer = getattr(trainer, "checkpointer", None)
        if checkpointer is None or not checkpointer.is_main or not checkpointer.folder.is_dir():
            return
        pattern = _pattern(self.filename)
        known = {k[1] for k in self.kept}
        for path in checkpointer.folder.iterdir():
            stem = path.name.removesuffix(".pt")
            if stem not in known and stem != "best" and pattern.fullmatch(stem):
                checkpointer.remove(stem)
        if self.kept and self.kept[0][1] != "best":
            checkpointer.link(self.kept[0][1], "best")

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [list(k) for k in self.kept], "best_val_loss": self.kept[0][0] if self.kept else math.inf}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "kept" in state:
            self.kept = [(float(v), str(n), int(e), int(s)) for v, n, e, s in state["kept"]]
        elif math.isfinite(float(state.get("best_val_loss", math.inf))):  # a SaveBestCheckpoint of before
            self.kept = [(float(state["best_val_loss"]), "best", 0, 0)]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(monitor={self.monitor!r}, mode={self.mode!r}, save_top_k={self.save_top_k}, "
                f"save_last={self.save_last})")


def _rank0(trainer: Any, value: float) -> float:
    """Rank 0's value on every rank (metrics not reduced over ranks differ; the decision to save must not)."""
    acc = getattr(trainer, "accelerator", None)
    return float(acc.broadcast(value, 0)) if acc is not None and acc.world_size > 1 else value


def _pattern(template: str) -> re.Pattern[str]:
    """The names a filename template produces (for the files a stopped run left)."""
    parts = re.split(r"(\{epoch\}|\{step\}|\{value\})", template)
    return re.compile("".join({"{epoch}": r"\d+", "{step}": r"\d+", "{value}": r"[-+.\deEinfa]+"}.get(p, re.escape(p))
                              for p in parts))


class SaveBestCheckpoint(ModelCheckpoint):
    """qadence's callback: save ``best.pt`` when ``validation_criterion(val_loss, best, eps)`` says so (default: lower
    by eps). Outside ``fit()`` the result's loss is used."""

    def __init__(self, on: str = "val_epoch_end", called_every: int = 1, **kwargs: Any) -> None:
        super().__init__(monitor="val_loss", mode="min", save_top_k=1, filename="best", on=on,
                         called_every=called_every, **kwargs)

    @property
    def events(self) -> tuple[str, ...]:
        return (self.on,)

    @property
    def best_val_loss(self) -> float:
        return self.kept[0][0] if self.kept else math.inf

    @best_val_loss.setter
    def best_val_loss(self, value: float) -> None:
        self.kept = [(float(value), "best", 0, 0)] if math.isfinite(value) else []

    def run_callback(self, trainer: Any, config: Any, writer: Any) -> Any:
        self.criterion = config.validation_criterion if config is not None else None
        self.min_delta = config.val_epsilon if config is not None else 0.0
        return super().run_callback(trainer, config, writer)

    def value(self, trainer: Any) -> float | None:
        result = trainer.opt_result  # qadence reads the result's loss; inside fit() the validation loss
        if result.loss is None and "val_loss" not in result.metrics:
            raise ConfigError("SaveBestCheckpoint: there is no loss to compare (trainer.opt_result.loss is None and "
                              "no val_loss was computed): outside fit() it compares opt_result.loss. HINT: call it "
                              "after fit(), or set trainer.opt_result.loss first, as qadence's tests do.")
        return _rank0(trainer, float(result.metrics.get("val_loss", result.loss)))


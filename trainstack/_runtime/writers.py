"""Metric writers (rank 0 only): JSON lines always, TensorBoard, MLflow or W&B when asked."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .._text import number
from ..errors import ConfigError

__all__ = ["Writers", "NullWriter", "make_writers", "format_metrics"]

log = logging.getLogger(__name__)


def _scalar(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def format_metrics(epoch: int, metrics: dict[str, Any], step: int | None = None, epochs: int | None = None) -> str:
    """``epoch 3/10 | step 120 | train_loss 0.1235 | ...``: the live line's format (the host sync of ``.item()``
    happens here, once per line)."""
    head = f"epoch {epoch}" + (f"/{epochs}" if epochs else "") + (f" | step {step}" if step is not None else "")
    return " | ".join([head, *(f"{k} {number(_scalar(v))}" for k, v in metrics.items())])


class JsonlWriter:
    """``metrics.jsonl``: one JSON object per write; dependency-free and append-only (resume-friendly).

    ``keep_through`` (a resumed run: the step its checkpoint was written at) drops the rows the stopped run wrote
    after that step, which the resumed run writes again; without it they would appear twice. Rows are compared by
    step, never by wall time (a row written just before the checkpoint must not be lost to rounding).
    """

    def __init__(self, folder: Path, keep_through: int | None = None) -> None:
        from .._files import open_append

        self.path = Path(folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through is not None and self.path.exists():
            self._drop_rows_after(keep_through)
        self._fh = open_append(self.path)

    def rows(self) -> list[dict[str, Any]]:
        """The rows written so far (a line cut short by a kill is skipped)."""
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out

    def _drop_rows_after(self, step: int) -> None:
        from .._files import atomic_write

        kept = [row for row in self.rows() if int(row.get("step", -1)) <= step]
        atomic_write(self.path, "".join(json.dumps(row) + "\n" for row in kept), mode=0o600)

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        row: dict[str, Any] = {} if epoch is None else {"epoch": epoch}
        if iteration is not None:
            row["iteration"] = iteration  # qadence's key: the epoch of an epoch row, the batch of a callback's row
        row.update({"step": step, "time": round(time.time(), 3), **metrics})
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        from .._files import atomic_write

        atomic_write(self.path.with_name("hyperparams.json"), json.dumps(
            {k: v if isinstance(v, (int, float, str, bool)) else repr(v) for k, v in hyperparams.items()}, indent=2))

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        out = self.path.with_name("plots") / f"{name}_{iteration}.png"
        out.parent.mkdir(exist_ok=True)
        figure.savefig(out)

    def close(self) -> None:
        self._fh.close()


class TensorBoardWriter:
    """TensorBoard scalars with the optimizer step as x; a resumed run purges the events written after its
    checkpoint's step."""

    def __init__(self, folder: Path, purge_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("tracking_tool='tensorboard' needs the tensorboard package. HINT: "
                              "pip install 'trainstack[tensorboard]'.") from None
        self.sw = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        for k, v in metrics.items():
            self.sw.add_scalar(k, v, step)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        clean = {k: v for k, v in hyperparams.items() if isinstance(v, (int, float, str, bool))}
        self.sw.add_hparams(clean, {})

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        self.sw.add_figure(name, figure, global_step=iteration)

    def close(self) -> None:
        self.sw.close()


class TrackerIds:
    """``trackers.json`` in the run folder: what a restart needs to continue the same tracker run (MLflow's run id,
    whether its parameters are logged)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / "trackers.json"
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.data = {}

    def save(self) -> None:
        from .._files import atomic_write

        atomic_write(self.path, json.dumps(self.data), mode=0o600)


class MLflowWriter:
    """MLflow tracking; ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` and ``MLFLOW_RUN_NAME`` apply. Every
    restart resumes the same MLflow run (its id is in ``trackers.json``) and sends only the rows after the last
    step MLflow holds (an append-only store cannot take rows back; the stopped attempt's rows after its checkpoint
    are the same rows where training is bitwise), so the run's history is the uninterrupted run's, no duplicate."""

    def __init__(self, folder: Path, ids: TrackerIds, run_id: str | None) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("tracking_tool='mlflow' needs mlflow. HINT: pip install 'trainstack[mlflow]'.") from None
        self.mlflow, self.ids = mlflow, ids
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trainstack")
        if mlflow.get_experiment_by_name(experiment) is None:
            mlflow.create_experiment(experiment)
        mlflow.set_experiment(experiment)
        known = ids.data.get("mlflow_run_id")
        self.run = mlflow.start_run(run_id=known) if known else mlflow.start_run(
            run_name=os.environ.get("MLFLOW_RUN_NAME", Path(folder).name), tags={"trainstack.run_id": run_id or ""})
        if not known:
            ids.data["mlflow_run_id"] = self.run.info.run_id
            ids.save()
        held = mlflow.tracking.MlflowClient().get_run(self.run.info.run_id).data._metric_objs if known else []
        self.held_step = max((m.step for m in held), default=-1)  # the latest step MLflow has, with its keys
        self.held_keys = {m.key for m in held if m.step == self.held_step}

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        if step < self.held_step or (step == self.held_step and set(metrics) <= self.held_keys):
            return  # an earlier attempt sent this row
        self.mlflow.log_metrics(metrics, step=step)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        if not self.ids.data.get("mlflow_params"):  # once per run: MLflow refuses to change a logged parameter
            self.mlflow.log_params(hyperparams)
            self.ids.data["mlflow_params"] = True
            self.ids.save()

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        self.mlflow.log_figure(figure, f"{name}_{iteration}.png")

    def log_model(self, model: Any) -> None:
        import mlflow.pytorch

        mlflow.pytorch.log_model(model, artifact_path="model")

    def close(self) -> None:
        self.mlflow.end_run()


class WandbWriter:
    """Weights & Biases: rank 0 only; the run's id is trainstack's run id, resumed (``resume="allow"``) on every
    restart, so a requeued job is one W&B run. W&B buffers: a killed attempt loses the rows it had not flushed. So a
    restart replays the history its checkpoint covers (metrics.jsonl) and then goes on; W&B keeps only rows past
    the last step it holds (a resumed run's steps only move forward), so its history is the uninterrupted run's,
    with nothing lost and nothing twice. ``WANDB_PROJECT`` (default ``trainstack``), ``WANDB_ENTITY`` and
    ``WANDB_MODE=offline`` (tests, air-gapped clusters; ``wandb sync`` later) apply; files go to ``<run>/wandb/``."""

    def __init__(self, folder: Path, ids: TrackerIds, run_id: str | None, replay: list[dict[str, Any]]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("tracking_tool='wandb' needs wandb. HINT: pip install 'trainstack[wandb]' (set "
                              "WANDB_MODE=offline where the cluster has no internet).") from None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "trainstack"), id=run_id, resume="allow",
                              dir=str(folder), name=os.environ.get("WANDB_NAME", Path(folder).name),
                              settings=wandb.Settings(console="off", silent=True))
        for row in replay:
            metrics = {k: v for k, v in row.items() if k not in ("step", "time", "epoch", "iteration")}
            if metrics:
                self.run.log(metrics, step=int(row["step"]))

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        self.run.config.update({k: v if isinstance(v, (int, float, str, bool)) else repr(v)
                                for k, v in hyperparams.items()}, allow_val_change=True)

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        import wandb

        self.run.log({name: wandb.Image(figure)}, commit=False)

    def log_model(self, model: Any) -> None:
        pass  # the checkpoints in the run folder are the model; W&B artifacts are the user's choice

    def close(self) -> None:
        self.run.finish()


class Writers:
    """Fan-out to the active writers, keeping the metric history for the final loss curve. Every row is stamped
    with the run's step (``clock``), which a resumed run compares with its checkpoint's."""

    def __init__(self, folder: Path, writers: list[Any], clock: Any = None) -> None:
        self.folder = Path(folder)
        self.writers = writers
        self.history: list[dict[str, float]] = []
        self.clock = clock

    def write(self, iteration: int | None, metrics: dict[str, Any], epoch: float | None = None) -> None:
        """One row: ``iteration`` is qadence's (the epoch of an epoch row; a callback's own count), ``epoch`` the
        epoch (fractional in a step row); the step is the run's optimizer step."""
        clean = {k: _scalar(v) for k, v in metrics.items()}
        step = int(self.clock()) if self.clock is not None else 0
        self.history.append({"step": step, **clean})
        for w in self.writers:
            w.write(iteration, clean, step, epoch)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        for w in self.writers:
            w.log_hyperparams(hyperparams)

    def plot(self, model: Any, iteration: int, plotting_functions: tuple) -> None:
        for fn in plotting_functions:
            name, figure = fn(model, iteration)
            for w in self.writers:
                w.add_figure(name, figure, iteration)

    def log_model(self, model: Any) -> None:
        loggers = [w for w in self.writers if hasattr(w, "log_model")]
        if not loggers:
            log.warning("log_model=True but the tracking tool cannot store models (use tracking_tool='mlflow').")
        for w in loggers:
            w.log_model(model)

    def close(self) -> None:
        for w in self.writers:
            w.close()


class NullWriter(Writers):
    """What non-main ranks get: every call is a no-op."""

    def __init__(self) -> None:
        super().__init__(Path("."), [])

    def write(self, iteration: int | None, metrics: dict[str, Any], epoch: float | None = None) -> None:
        pass


def make_writers(tool: str, folder: Path, keep_through: int | None = None, clock: Any = None,
                 run_id: str | None = None) -> Writers:
    """The writers of ``tool`` (and metrics.jsonl) for run ``run_id``; ``keep_through``: a resumed run's checkpoint
    step, after which rows of the stopped run are dropped (metrics.jsonl, TensorBoard) or not sent twice (MLflow,
    W&B: see their writers)."""
    writers: list[Any] = [JsonlWriter(folder, keep_through)]
    if tool == "tensorboard":
        writers.append(TensorBoardWriter(folder, keep_through + 1 if keep_through is not None else None))
    elif tool == "mlflow":
        writers.append(MLflowWriter(folder, TrackerIds(folder), run_id))
    elif tool == "wandb":
        writers.append(WandbWriter(folder, TrackerIds(folder), run_id, writers[0].rows() if keep_through else []))
    return Writers(folder, writers, clock)

"""Metric writers (rank 0 only): JSON lines always, TensorBoard, MLflow or W&B when asked."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._common.files import WRITE_FAILURES
from .._common.text import number
from ..errors import ConfigError, TrainstackError

__all__ = ["Writers", "NullWriter", "make_writers", "format_metrics"]

log = logging.getLogger(__name__)


def _scalar(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def format_metrics(epoch: int, metrics: dict[str, Any], step: int | None = None, epochs: int | None = None) -> str:
    """``epoch 3/10 | step 120 | train_loss 0.1235 | ...``: the live line's format (the host sync of ``.item()``
    happens here, once per line)."""
    head = f"epoch {epoch}" + (f"/{epochs}" if epochs else "") + (f" | step {step}" if step is not None else "")
    return " | ".join([head, *(f"{k} {number(_scalar(v))}" for k, v in metrics.items())])


class MetricsWriteError(TrainstackError, OSError):
    """metrics.jsonl could not be written (the cause in words: a full disk, a quota, permissions)."""


class JsonlWriter:
    """``metrics.jsonl``: one JSON object per write; dependency-free and append-only (resume-friendly).

    ``keep_through`` (a resumed run: the step its checkpoint was written at) drops the rows the stopped run wrote
    after that step, which the resumed run writes again; without it they would appear twice. Rows are compared by
    step, never by wall time (a row written just before the checkpoint must not be lost to rounding).
    """

    def __init__(self, folder: Path, keep_through: int | None = None) -> None:
        from .._common.files import open_append

        self.path = Path(folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_through is not None and self.path.exists():
            self._drop_rows_after(keep_through)
        self._fh = open_append(self.path)

    def rows(self) -> list[dict[str, Any]]:
        """The rows written so far (a line cut short by a kill is skipped)."""
        from .._common.files import read_jsonl

        return read_jsonl(self.path, owner=None)  # the run folder's own metrics, whatever the umask made them

    def _drop_rows_after(self, step: int) -> None:
        from .._common.files import atomic_write

        kept = [row for row in self.rows() if int(row.get("step", -1)) <= step]
        atomic_write(self.path, "".join(json.dumps(row) + "\n" for row in kept), mode=0o600)

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        row: dict[str, Any] = {} if epoch is None else {"epoch": epoch}
        if iteration is not None:
            row["iteration"] = iteration  # qadence's key: the epoch of an epoch row, the batch of a callback's row
        row.update({"step": step, "time": round(time.time(), 3), **metrics})
        try:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()
        except OSError as exc:
            reason = WRITE_FAILURES.get(exc.errno or 0, exc.strerror or str(exc))
            raise MetricsWriteError(f"could not write {self.path}: {reason}. HINT: free space (a compile cache or "
                                    f"old checkpoints are often the largest files), or another root_folder / "
                                    f"log_folder.") from None

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        from .._common.files import atomic_write

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
        from .._common.files import atomic_write

        atomic_write(self.path, json.dumps(self.data), mode=0o600)


class MLflowWriter:
    """MLflow tracking; ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` and ``MLFLOW_RUN_NAME`` apply. Every
    restart resumes the MLflow run tagged with trainstack's run id (``trainstack.run_id``: a copied run folder has
    an id of its own, a deleted ``trackers.json`` loses nothing) and sends only the rows after the last step MLflow
    holds (an append-only store cannot take rows back; the stopped attempt's rows after its checkpoint are the same
    rows where training is bitwise), so the run's history is the uninterrupted run's, no duplicate. A store that
    cannot be reached or written is a clear error at the start, never minutes of silence."""

    def __init__(self, folder: Path, ids: TrackerIds, run_id: str | None) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("tracking_tool='mlflow' needs mlflow. HINT: pip install 'trainstack[mlflow]'.") from None
        self.mlflow, self.ids = mlflow, ids
        uri = mlflow.get_tracking_uri()
        if _reachable(uri):  # a server: a bounded wait per call, not MLflow's minutes of retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        ours = set(os.environ)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trainstack")
        try:
            if mlflow.get_experiment_by_name(experiment) is None:
                mlflow.create_experiment(experiment)
            mlflow.set_experiment(experiment)
            known = self._run_of(experiment, run_id)
            self.run = mlflow.start_run(run_id=known) if known else mlflow.start_run(
                run_name=os.environ.get("MLFLOW_RUN_NAME", Path(folder).name),
                tags={"trainstack.run_id": run_id or ""})
        except ConfigError:
            raise
        except Exception as exc:  # the store's own error (a file store MLflow 3 refuses, a read-only folder, ...)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"MLflow at {uri} cannot be used: {type(exc).__name__}: {first}. HINT: set "
                              f"MLFLOW_TRACKING_URI to a store you can write (a server http://..., or "
                              f"sqlite:///$PWD/mlflow.db; a file store ./mlruns needs MLFLOW_ALLOW_FILE_STORE=true "
                              f"with MLflow 3), or tracking_tool='jsonl'.") from None
        finally:
            for key in set(os.environ) - ours:  # MLflow's own note of the active experiment: not the user's env
                if key == "MLFLOW_EXPERIMENT_ID":
                    del os.environ[key]
        if ids.data.get("mlflow_run_id") != self.run.info.run_id:
            ids.data["mlflow_run_id"] = self.run.info.run_id
            ids.save()
        held = mlflow.tracking.MlflowClient().get_run(self.run.info.run_id).data._metric_objs if known else []
        self.held_step = max((m.step for m in held), default=-1)  # the latest step MLflow has, with its keys
        self.held_keys = {m.key for m in held if m.step == self.held_step}

    def _run_of(self, experiment: str, run_id: str | None) -> str | None:
        """The MLflow run of trainstack run ``run_id`` (by its tag), else None: a new one is started."""
        if not run_id:
            return None
        found = self.mlflow.search_runs(experiment_names=[experiment], output_format="list", max_results=1,
                                        filter_string=f"tags.`trainstack.run_id` = '{run_id}'")
        return found[0].info.run_id if found else None

    def write(self, iteration: int | None, metrics: dict[str, float], step: int = 0,
              epoch: float | None = None) -> None:
        if step == self.held_step:  # an earlier attempt sent (part of) this row: only what it did not send
            metrics = {k: v for k, v in metrics.items() if k not in self.held_keys}
        if step < self.held_step or not metrics:
            return  # an earlier attempt sent this row
        self.mlflow.log_metrics(metrics, step=step)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        logged = self.mlflow.tracking.MlflowClient().get_run(self.run.info.run_id).data.params
        fresh = {k: v for k, v in hyperparams.items() if k not in logged}  # MLflow refuses to change a logged one
        if fresh:
            self.mlflow.log_params(fresh)

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


def _reachable(uri: str, timeout: float = 5.0) -> bool:
    """True for an ``http(s)://`` tracking server that answers; one that does not within ``timeout`` is a clear
    error now -- MLflow's own retries would wait minutes before every attempt's first step. False: not a server."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return False
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"the MLflow server {uri} does not answer ({exc.strerror or exc}; waited {timeout:g} s). "
                          f"HINT: start it, or check MLFLOW_TRACKING_URI (from a compute node: is the server "
                          f"reachable from there?), or tracking_tool='jsonl'.") from None
    return True


class Writers:
    """Fan-out to the active writers, keeping the metric history for the final loss curve. Every row is stamped
    with the run's step (``clock``), which a resumed run compares with its checkpoint's. A tracker that fails while
    training (a server gone, a full or read-only store) is warned about once and left out; training goes on and
    metrics.jsonl keeps every row."""

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
        self._each("write", iteration, clean, step, epoch)

    def _each(self, method: str, *args: Any) -> None:
        """Call ``method`` of every writer; a tracker that raises is warned about once and dropped (metrics.jsonl,
        the run's own record, is not: its errors reach the caller)."""
        for w in list(self.writers):
            if isinstance(w, JsonlWriter):
                getattr(w, method)(*args)
                continue
            try:
                getattr(w, method)(*args)
            except Exception as exc:
                self.writers.remove(w)
                print(f"trainstack: WARNING: the {type(w).__name__.removesuffix('Writer')} tracker failed "
                      f"({type(exc).__name__}: {str(exc).strip()[:200]}); training goes on without it, and "
                      f"metrics.jsonl keeps every row.", flush=True)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        self._each("log_hyperparams", hyperparams)

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


def make_writers(tool: str | Sequence[str], folder: Path, keep_through: int | None = None, clock: Any = None,
                 run_id: str | None = None) -> Writers:
    """The writers of ``tool`` (and metrics.jsonl) for run ``run_id``; ``keep_through``: a resumed run's checkpoint
    step, after which rows of the stopped run are dropped (metrics.jsonl, TensorBoard) or not sent twice (MLflow,
    W&B: see their writers)."""
    writers: list[Any] = [JsonlWriter(folder, keep_through)]
    for name in [tool] if isinstance(tool, str) else tool:
        if name == "tensorboard":
            writers.append(TensorBoardWriter(folder, keep_through + 1 if keep_through is not None else None))
        elif name == "mlflow":
            writers.append(MLflowWriter(folder, TrackerIds(folder), run_id))
        elif name == "wandb":
            writers.append(WandbWriter(folder, TrackerIds(folder), run_id, writers[0].rows() if keep_through
                                       else []))
    return Writers(folder, writers, clock)

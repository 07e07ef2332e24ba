"""Metric writers (rank 0 only): JSON lines always, TensorBoard or MLflow when asked, a loss-curve PNG."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["Writers", "NullWriter", "make_writers", "save_loss_curve", "format_metrics"]

log = logging.getLogger(__name__)


def _scalar(value: Any) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def format_metrics(iteration: int, metrics: dict[str, Any]) -> str:
    """``Iteration N | train_loss: 0.1234567 | ...`` (the host sync of ``.item()`` happens here, once per line)."""
    def fmt(value: Any) -> str:
        v = _scalar(value)
        return f"{v:.7f}" if abs(v) >= 1e-4 or v == 0 else f"{v:.4e}"

    return f"Iteration {iteration:>6} | " + " | ".join(f"{k}: {fmt(v)}" for k, v in metrics.items())


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

    def _drop_rows_after(self, step: int) -> None:
        from .._files import atomic_write

        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(row, dict) and int(row.get("step", -1)) <= step:
                kept.append(line)
        atomic_write(self.path, "".join(f"{line}\n" for line in kept), mode=0o600)

    def write(self, iteration: int, metrics: dict[str, float], step: int = 0) -> None:
        row = {"iteration": iteration, "step": step, "time": round(time.time(), 3), **metrics}
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
    def __init__(self, folder: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("tracking_tool='tensorboard' needs the tensorboard package. HINT: "
                              "pip install 'trainstack[tensorboard]'.") from None
        self.sw = SummaryWriter(log_dir=str(folder), purge_step=start_step or None)

    def write(self, iteration: int, metrics: dict[str, float], step: int = 0) -> None:
        for k, v in metrics.items():
            self.sw.add_scalar(k, v, iteration)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        clean = {k: v for k, v in hyperparams.items() if isinstance(v, (int, float, str, bool))}
        self.sw.add_hparams(clean, {})

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        self.sw.add_figure(name, figure, global_step=iteration)

    def close(self) -> None:
        self.sw.close()


class MLflowWriter:
    """MLflow tracking; ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` and ``MLFLOW_RUN_NAME`` apply."""

    def __init__(self, folder: Path) -> None:
        try:
            import mlflow
        except ImportError:
            raise ConfigError("tracking_tool='mlflow' needs mlflow. HINT: pip install 'trainstack[mlflow]'.") from None
        self.mlflow = mlflow
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "trainstack")
        if mlflow.get_experiment_by_name(experiment) is None:
            mlflow.create_experiment(experiment)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=os.environ.get("MLFLOW_RUN_NAME", Path(folder).name))

    def write(self, iteration: int, metrics: dict[str, float], step: int = 0) -> None:
        self.mlflow.log_metrics(metrics, step=iteration)

    def log_hyperparams(self, hyperparams: dict[str, Any]) -> None:
        self.mlflow.log_params(hyperparams)

    def add_figure(self, name: str, figure: Any, iteration: int) -> None:
        self.mlflow.log_figure(figure, f"{name}_{iteration}.png")

    def log_model(self, model: Any) -> None:
        import mlflow.pytorch

        mlflow.pytorch.log_model(model, artifact_path="model")

    def close(self) -> None:
        self.mlflow.end_run()


class Writers:
    """Fan-out to the active writers, keeping the metric history for the final loss curve. Every row is stamped
    with the run's step (``clock``), which a resumed run compares with its checkpoint's."""

    def __init__(self, folder: Path, writers: list[Any], clock: Any = None) -> None:
        self.folder = Path(folder)
        self.writers = writers
        self.history: list[dict[str, float]] = []
        self.clock = clock

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        clean = {k: _scalar(v) for k, v in metrics.items()}
        self.history.append({"iteration": iteration, **clean})
        step = int(self.clock()) if self.clock is not None else 0
        for w in self.writers:
            w.write(iteration, clean, step)

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

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        pass


def make_writers(tool: str, folder: Path, start_step: int, keep_through: int | None = None,
                 clock: Any = None) -> Writers:
    writers: list[Any] = [JsonlWriter(folder, keep_through)]
    if tool == "tensorboard":
        writers.append(TensorBoardWriter(folder, start_step))
    elif tool == "mlflow":
        writers.append(MLflowWriter(folder))
    return Writers(folder, writers, clock)


def save_loss_curve(history: list[dict[str, float]], path: Path) -> Path | None:
    """Plot every ``*_loss`` series of the history to a PNG (skipped when matplotlib is missing)."""
    keys = sorted({k for row in history for k in row if k.endswith("loss")})
    if not keys:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no loss curve (pip install 'trainstack[plot]').")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        points = [(row["iteration"], row[key]) for row in history if key in row and math.isfinite(row[key])]
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None, label=key)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_yscale("log" if all(row[k] > 0 for row in history for k in keys if k in row) else "linear")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    from .._files import temp_path

    path = Path(path)
    tmp = temp_path(path, suffix=".png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)  # never a truncated PNG (e.g. on a full disk)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path

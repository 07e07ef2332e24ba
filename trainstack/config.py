"""`TrainConfig`: every training setting in one keyword dataclass, validated when it is built.

Names and meanings follow the qadence reference (``max_iter``, ``print_every``, ``val_every`` ...);
additions follow what Accelerate/Lightning users expect (``seed``, ``gradient_accumulation_steps`` ...).
A bad or contradictory value fails here, with the field name and the fix, not hours into a job.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ._choices import (
    BACKENDS,
    CHECKPOINT_FORMATS,
    COMPUTE_SETUPS,
    DEFAULT_COMPUTE_SETUP,
    LOG_SETUPS,
    MIXED_PRECISION,
    STRATEGIES,
    TRACKING_TOOLS,
)
from .errors import ConfigError

__all__ = ["TrainConfig"]


@dataclass(kw_only=True)
class TrainConfig:
    """Settings of one training run (see the README table for every field)."""

    max_iter: int = 10000
    """Number of passes (epochs) over the training data -- exactly this many."""
    print_every: int = 0
    """Print one metrics line from rank 0 every N epochs (0: never). Needs ``verbose``."""
    write_every: int = 0
    """Write metrics to the tracker every N epochs (0: only at the end). metrics.jsonl is always written."""
    checkpoint_every: int = 0
    """Save a checkpoint every N epochs and at the end (0: never, unless ``resume`` is on)."""
    plot_every: int = 0
    """Call ``plotting_functions`` every N epochs (0: never)."""
    val_every: int = 0
    """Validate every N epochs (0: never). Needs a validation DataLoader."""
    val_epsilon: float = 1e-5
    """Passed to ``validation_criterion``."""
    validation_criterion: Callable[[float, float, float], bool] | None = None
    """``(val_loss, best_val_loss, val_epsilon) -> bool``: is this validation the new best? Default: lower by eps."""
    checkpoint_best_only: bool = False
    """Save only the best checkpoint (by ``validation_criterion``) at each validation."""
    trainstop_criterion: Callable[[Any], bool] | None = None
    """``(trainer) -> bool`` checked after every epoch; True stops training on every rank."""
    callbacks: list = field(default_factory=list)
    """User :class:`~trainstack.callbacks.Callback` objects."""
    log_model: bool = False
    """Log the final model to the tracker (MLflow)."""
    root_folder: Path = Path("./qml_logs")
    """Parent folder of the per-run folders."""
    create_subfolder_per_run: bool = False
    """Create a new run folder on every ``fit`` even when one could be reused."""
    log_folder: Path = Path("./")
    """Explicit run folder; ``./`` (the default) means a new subfolder of ``root_folder``."""
    verbose: bool = True
    """Print the banner, metrics lines and the progress bar (rank 0 only)."""
    tracking_tool: str = "jsonl"
    """``jsonl`` (dependency-free, always written), ``tensorboard`` or ``mlflow`` (optional extras)."""
    batch_size: int = 1
    """Not used (nor was it by qadence): the DataLoader's ``batch_size`` decides. A value other than 1 warns."""
    hyperparams: dict = field(default_factory=dict)
    """Logged to the tracker at the end of training."""
    plotting_functions: tuple = ()
    """Functions ``(model, iteration) -> (description, matplotlib Figure)``."""
    nprocs: int = 1
    """Total number of processes (all nodes). Under torchrun the launcher's count wins."""
    compute_setup: str = DEFAULT_COMPUTE_SETUP
    """``auto`` (GPU when available, else CPU), ``gpu`` or ``cpu``; the same default as ``Accelerator``."""
    backend: str | None = None
    """``None`` (nccl on GPU, gloo on CPU), ``nccl``, ``gloo`` or ``mpi``."""
    log_setup: str = "cpu"
    """Where reduced metrics live: ``cpu`` or ``auto`` (the compute device)."""
    dtype: torch.dtype | None = None
    """Model dtype; floating batch tensors are cast to it."""
    all_reduce_metrics: bool = False
    """Average training metrics over all ranks once per epoch (validation metrics always are)."""
    seed: int | None = None
    """Seed Python/NumPy/torch (``seed + rank`` per process) and the data shuffle. None: leave RNGs alone."""
    gradient_accumulation_steps: int = 1
    """Optimizer step every N batches (no DDP gradient sync on the others)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this value before each optimizer step."""
    mixed_precision: str = "no"
    """``no``, ``bf16`` (autocast; with fsdp, FSDP's bf16 compute with fp32 reductions) or ``fp16`` (autocast +
    GradScaler, CUDA only)."""
    strategy: str = "ddp"
    """``ddp``: every process holds the whole model. ``fsdp``: FSDP2 shards parameters, gradients and optimizer
    state across the processes (for models that outgrow one device)."""
    fsdp_blocks: tuple[str, ...] | None = None
    """With fsdp: the module classes to shard one by one (e.g. ``("TransformerEncoderLayer",)``); None: every
    submodule holding at least ``fsdp_min_params`` parameters."""
    fsdp_min_params: int = 1_000_000
    """With fsdp and no ``fsdp_blocks``: the size of a block."""
    checkpoint_format: str = "auto"
    """``file`` (one file, rank 0 writes), ``sharded`` (a DCP folder, every rank writes its shard; resumes on any
    number of processes) or ``auto`` (sharded for fsdp, file for ddp)."""
    async_checkpoint: bool = False
    """Sharded checkpoints only: write in the background; training waits only while the state is copied."""
    max_batches: int | None = None
    """Use at most this many batches per epoch. An endless loader (``to_dataloader(..., infinite=True)``) takes
    this many per epoch (1 when unset, as qadence does)."""
    resume: str | Path | None = None
    """``"auto"``: continue from the latest complete checkpoint of the run folder; a path: that checkpoint."""
    keep_last_checkpoints: int | None = None
    """Keep only the newest N periodic checkpoints (None: keep all). ``best.pt`` is kept separately."""
    stop_signals: tuple[str, ...] | None = None
    """Signals that request a graceful stop (checkpoint, then exit 0). None: ``TRAINSTACK_STOP_SIGNALS`` or SIGUSR2."""
    stop_file: Path | None = None
    """A file whose existence requests a graceful stop. None: ``TRAINSTACK_STOP_FILE`` (set by generated scripts)."""
    stop_check_every: int = 20
    """Poll for stop requests every N batches (one small all-reduce when distributed) and at every epoch end."""
    hang_timeout: float | None = None
    """Seconds without progress on every rank before the hang watchdog dumps every rank's stacks into the run folder
    (``hang-<id>/``), names the rank that is behind, and exits (code 124) so the job can be restarted. Three times
    as long before the first step and during checkpoints. None: ``TRAINSTACK_HANG_TIMEOUT`` or 600; 0: off."""
    stop_on_nonfinite: bool = True
    """Stop when an epoch's training loss is NaN or infinite (checked on the epoch mean: no extra sync); the last
    finite checkpoint is kept. False: train on."""

    def __post_init__(self) -> None:
        self.root_folder = _as_path("root_folder", self.root_folder)
        self.log_folder = _as_path("log_folder", self.log_folder)
        for name in ("max_iter", "print_every", "write_every", "checkpoint_every", "plot_every", "val_every"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("nprocs", self.nprocs, minimum=1)
        _check_int("batch_size", self.batch_size, minimum=1)
        _check_int("fsdp_min_params", self.fsdp_min_params, minimum=1)
        if self.hang_timeout is not None and (isinstance(self.hang_timeout, bool) or not isinstance(
                self.hang_timeout, (int, float)) or self.hang_timeout < 0):
            raise ConfigError(f"TrainConfig.hang_timeout={self.hang_timeout!r} must be a number of seconds >= 0 (0 "
                              f"turns the hang watchdog off) or None.")
        if self.fsdp_blocks is not None:
            if isinstance(self.fsdp_blocks, str) or not all(isinstance(b, str) for b in self.fsdp_blocks):
                raise ConfigError(f"TrainConfig.fsdp_blocks={self.fsdp_blocks!r} must be a tuple of module class "
                                  f"names, e.g. ('TransformerEncoderLayer',).")
            self.fsdp_blocks = tuple(self.fsdp_blocks)
        if self.batch_size != 1:
            warnings.warn(f"TrainConfig.batch_size={self.batch_size} is not used (nor was it by qadence): the "
                          f"DataLoader's batch_size decides.", stacklevel=3)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        _check_int("stop_check_every", self.stop_check_every, minimum=1)
        if self.stop_file is not None:
            self.stop_file = _as_path("stop_file", self.stop_file)
        if self.stop_signals is not None:
            from ._runtime.preemption import resolve_signals

            resolve_signals(self.stop_signals)  # a plain string is refused before it could become characters
            self.stop_signals = tuple(self.stop_signals)
        for name in ("max_batches", "keep_last_checkpoints", "seed"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0 if name == "seed" else 1)
        self._check_choices()
        self._check_callables()
        self._check_combinations()
        # A valid multi-process config: let the workers' fork server import torch while the script goes on
        # building its model and data (trainstack._runtime.preload; TRAINSTACK_PRELOAD=0 turns it off).
        from ._runtime.preload import start_for

        start_for(self.nprocs)

    def _check_choices(self) -> None:
        choices = {"compute_setup": COMPUTE_SETUPS, "backend": BACKENDS, "log_setup": LOG_SETUPS,
                   "strategy": STRATEGIES, "checkpoint_format": CHECKPOINT_FORMATS,
                   "tracking_tool": TRACKING_TOOLS, "mixed_precision": MIXED_PRECISION}
        if hasattr(self.tracking_tool, "value"):  # accept enum-like values (qadence ExperimentTrackingTool)
            self.tracking_tool = str(self.tracking_tool.value)
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"TrainConfig.{name}={getattr(self, name)!r} is not one of {allowed}.")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype)
                                           and (self.dtype.is_floating_point or self.dtype.is_complex)):
            raise ConfigError(f"TrainConfig.dtype={self.dtype!r} must be a floating or complex torch.dtype (e.g. "
                              f"torch.float64) or None: model parameters cannot be integers.")
        if not isinstance(self.val_epsilon, (int, float)) or self.val_epsilon < 0:
            raise ConfigError(f"TrainConfig.val_epsilon={self.val_epsilon!r} must be a number >= 0.")
        if self.grad_clip_norm is not None and (not isinstance(self.grad_clip_norm, (int, float))
                                                or self.grad_clip_norm <= 0):
            raise ConfigError(f"TrainConfig.grad_clip_norm={self.grad_clip_norm!r} must be a number > 0 or None.")
        if self.resume not in (None, False, "auto") and not isinstance(self.resume, (str, os.PathLike)):
            raise ConfigError(f"TrainConfig.resume={self.resume!r} must be 'auto', a checkpoint path, or None.")
        if self.resume is False:  # type: ignore[comparison-overlap]  # qadence-style "off"
            self.resume = None

    def _check_callables(self) -> None:
        from .callbacks import Callback  # lazily: the callbacks package is only needed when a config is checked

        for name in ("validation_criterion", "trainstop_criterion"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"TrainConfig.{name}={value!r} must be a function or None.")
        if not isinstance(self.callbacks, (list, tuple)) or not all(isinstance(c, Callback) for c in self.callbacks):
            raise ConfigError(f"TrainConfig.callbacks must be a list of trainstack Callback objects, got "
                              f"{self.callbacks!r}.")
        self.callbacks = list(self.callbacks)
        if not all(callable(f) for f in self.plotting_functions):
            raise ConfigError("TrainConfig.plotting_functions must be functions (model, iteration) -> (name, figure).")
        if not isinstance(self.hyperparams, dict):
            raise ConfigError(f"TrainConfig.hyperparams must be a dict, got {type(self.hyperparams).__name__}.")

    def _check_combinations(self) -> None:
        if self.checkpoint_best_only and self.val_every == 0:
            raise ConfigError("TrainConfig.checkpoint_best_only=True needs validation: set val_every > 0 (and pass a "
                              "validation DataLoader).")
        if self.plot_every and not self.plotting_functions:
            raise ConfigError(f"TrainConfig.plot_every={self.plot_every} but plotting_functions is empty: nothing to "
                              f"plot. HINT: pass plotting_functions=(fn,) or set plot_every=0.")
        if self.create_subfolder_per_run and self.log_folder != Path("./"):
            raise ConfigError(f"TrainConfig.log_folder={str(self.log_folder)!r} and create_subfolder_per_run=True "
                              f"contradict each other: pick one run folder or a new subfolder of root_folder per run.")
        if self.resume == "auto" and self.create_subfolder_per_run:
            raise ConfigError("TrainConfig.resume='auto' cannot find earlier checkpoints when "
                              "create_subfolder_per_run=True makes a new folder every time. HINT: set one of them.")
        if self.async_checkpoint and self.checkpoint_format == "file" or self.async_checkpoint and \
                self.checkpoint_format == "auto" and self.strategy == "ddp":
            raise ConfigError("TrainConfig.async_checkpoint=True needs sharded checkpoints: set checkpoint_format="
                              "'sharded' (or strategy='fsdp').")
        if (self.fsdp_blocks or self.fsdp_min_params != 1_000_000) and self.strategy != "fsdp":
            raise ConfigError(f"TrainConfig.fsdp_blocks/fsdp_min_params only apply with strategy='fsdp' (strategy="
                              f"{self.strategy!r}).")
        if self.mixed_precision == "fp16" and self.compute_setup == "cpu":
            raise ConfigError("TrainConfig.mixed_precision='fp16' needs CUDA (GradScaler); on CPU use 'bf16' or 'no'.")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (loadable with ``torch.load(weights_only=True)``): functions become their names."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def changed(self) -> dict[str, Any]:
        """Fields that differ from their defaults (shown in the start banner)."""
        out = {}
        for f in fields(self):
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[operator]
            if getattr(self, f.name) != default:
                out[f.name] = getattr(self, f.name)
        return out


def _as_path(name: str, value: Any) -> Path:
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise ConfigError(f"TrainConfig.{name}={value!r} must be a path (str or pathlib.Path).")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"TrainConfig.{name}={value!r} must be an integer >= {minimum}.")


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (Path, torch.dtype)):
        return str(value)
    return getattr(value, "__name__", type(value).__name__)

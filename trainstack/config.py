"""`TrainConfig`: every training setting in one keyword dataclass, validated when it is built.

Names and meanings follow the qadence reference (``max_iter``, ``print_every``, ``val_every`` ...);
additions follow what Accelerate/Lightning users expect (``seed``, ``gradient_accumulation_steps`` ...).
A bad or contradictory value fails here, with the field name and the fix, not hours into a job.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, overload

import torch
from torch import nn

from ._common.choices import (
    BACKENDS,
    CHECKPOINT_FORMATS,
    COMPUTE_SETUPS,
    DEFAULT_COMPUTE_SETUP,
    LOG_SETUPS,
    MIXED_PRECISION,
    STRATEGIES,
    TRACKING_TOOLS,
    check_int,
)
from ._common.files import url_scheme
from ._runtime.compiling import compile_options
from ._runtime.parallel import Parallelism
from ._train import configread, runstore, schedule
from .errors import ConfigError, UnknownField

__all__ = ["TrainConfig"]


@dataclass(kw_only=True)
class TrainConfig:
    """Settings of one training run, every one validated when the config is built (a bad value names its field).

    ``TrainConfig.from_cli()`` reads ``--<field> value`` from the command line, ``TrainConfig.from_file(path)`` a
    YAML/TOML/JSON file; a run folder holds the ``config.yaml`` (or ``.json``) of what ran."""

    max_iter: int = 10000
    """Number of passes (epochs) over the training data -- exactly this many (counted from the run's start)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (with ``max_iter``: whichever comes first; counted from the run's start).
    None: no step limit."""
    print_every: int = 0
    """Print one metrics line from rank 0 every N epochs (0: never). Needs ``verbose``."""
    log_every_n_steps: int = 50
    """A live log line from rank 0 every N optimizer steps -- step, epoch, running loss, learning rate, samples/s and
    the values of ``trainer.log`` -- also written to ``metrics.jsonl`` and the tracker (0: off). On a terminal the
    progress bar shows them instead of printing lines."""
    log_every_seconds: float = 30.0
    """Without a terminal (a Slurm log), a line at least this often while training, between ``log_every_n_steps``
    lines (0: only those). No host sync is added per step either way."""
    val_every_n_steps: int = 0
    """Also validate every N optimizer steps (0: only every ``val_every`` epochs). Needs a validation DataLoader."""
    checkpoint_every_n_steps: int = 0
    """Also checkpoint every N optimizer steps, mid-epoch (0: only every ``checkpoint_every`` epochs); a resume from
    such a checkpoint continues bitwise at its batch."""
    memory_checkpoint_every_n_steps: int = 0
    """Also keep every rank's resume state in node memory (``/dev/shm``) every N optimizer steps, with a copy on a
    rank of another node (0: off). A restart (``resume="auto"``) continues from the newest complete set when it is
    newer than the durable checkpoint: a failure loses at most N steps. Written off the training thread."""
    write_every: int = 0
    """Write metrics to the tracker every N epochs (0: only at the end). metrics.jsonl is always written."""
    checkpoint_every: int = 0
    """Save a checkpoint every N epochs (0: only the final one, which a finished run writes)."""
    checkpoint_final: bool = True
    """Write the final checkpoint when the run finishes (False: benchmarks, throw-away runs; the others still)."""
    plot_every: int = 0
    """Call ``plotting_functions`` every N epochs (0: never)."""
    val_every: int = 0
    """Validate every N epochs (0: never). Needs a validation DataLoader."""
    val_epsilon: float = 1e-5
    """Passed to ``validation_criterion``."""
    validation_criterion: Callable[[float, float, float], bool] | None = None
    """``(val_loss, best_val_loss, val_epsilon) -> bool``: is this validation the new best? Default: lower by eps."""
    checkpoint_best_only: bool = False
    """Keep only ``best.pt``: the best checkpoint by ``val_loss`` (or ``validation_criterion``), decided at each
    validation (a shortcut for ``ModelCheckpoint(monitor="val_loss", filename="best")``)."""
    trainstop_criterion: Callable[[Any], bool] | None = None
    """``(trainer) -> bool`` checked after every epoch; True stops training on every rank."""
    callbacks: list = field(default_factory=list)
    """User ``Callback`` objects."""
    log_model: bool = False
    """Log the final model to the tracker (MLflow)."""
    root_folder: Path = Path("./qml_logs")
    """Parent folder of the per-run folders: a run without ``log_folder`` writes into
    ``<root_folder>/<date>-<time>-<pid>`` (``qml_logs`` is the name qadence users know). A file system path: an
    ``s3://`` (any URL) is refused rather than made a local folder named ``s3:``; mount the bucket instead."""
    create_subfolder_per_run: bool = False
    """Create a new run folder on every ``fit`` even when one could be reused."""
    log_folder: Path = Path("./")
    """Explicit run folder; ``./`` (the default) means a new subfolder of ``root_folder``."""
    verbose: bool = True
    """Print the banner, metrics lines and the progress bar (rank 0 only)."""
    tracking_tool: str = "jsonl"
    """``jsonl`` (dependency-free, always written), ``tensorboard``, ``mlflow`` or ``wandb`` (optional extras); a
    requeued or resumed run continues the same tracker run."""
    batch_size: int = 1
    """Not used: the DataLoader's ``batch_size`` decides (kept so that older configs load). A value other than 1
    warns."""
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
    seed_every_step: bool = False
    """With ``seed``: seed every rank again at each optimizer step, from the seed, its rank and the step, so a run
    restarted anywhere (a rank restarted in place beside survivors, a resume at another world size) continues the
    exact random streams (dropout) without carrying RNG state. The streams differ from those of one seeding."""
    gradient_accumulation_steps: int = 1
    """Optimizer step every N batches (no DDP gradient sync on the others)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient norm to this value before each optimizer step."""
    mixed_precision: str = "no"
    """``no``, ``bf16`` (autocast; with fsdp/hsdp, FSDP's bf16 compute with fp32 reductions), ``fp16`` (autocast +
    GradScaler; on a CPU too, as torch and Accelerate allow, though slow there: prefer ``bf16`` on CPUs) or ``fp8``
    (the Linear layers in float8 through torchao, the rest as bf16; GPUs of compute capability >= 8.9 only)."""
    compile: bool | dict[str, Any] = False
    """``torch.compile`` the model: True, or a dict of its options (``mode``, ``fullgraph``, ``dynamic``,
    ``backend``, ``options``). In place, so checkpoints keep the plain keys; the first step compiles under a long
    window; the compile cache lives in the run folder, so a requeued run starts warm."""
    strategy: str = "ddp"
    """``ddp``: every process holds the whole model. ``fsdp``: FSDP2 shards parameters, gradients and optimizer
    state across the processes (for models that outgrow one device). ``hsdp``: FSDP2 shards within a node and
    replicates across nodes (``hsdp_replicas``): the shards' collectives stay on the node's fast links."""
    fsdp_blocks: tuple[str, ...] | None = None
    """With fsdp/hsdp (and for ``activation_checkpointing``): the module classes to shard (checkpoint) one by one
    (e.g. ``("TransformerEncoderLayer",)``); None: every submodule holding at least ``fsdp_min_params``
    parameters."""
    fsdp_min_params: int = 1_000_000
    """With fsdp/hsdp and no ``fsdp_blocks``: the size of a block."""
    hsdp_replicas: int | None = None
    """With hsdp: how many full copies of the model (the data-parallel processes of each copy shard it). None: one
    per node."""
    activation_checkpointing: str | Callable[[nn.Module], bool] | None = None
    """Recompute each block's activations in the backward instead of keeping them (memory for compute):
    ``"full"`` (every block: ``fsdp_blocks``, else the blocks of ``fsdp_min_params``), ``"selective"`` (every
    second block), a function ``(module) -> bool`` choosing the modules, or None."""
    tensor_parallel_size: int = 1
    """Processes per tensor-parallel group (the mesh's innermost dimension ``tp``, inside a node; they read the same
    batches). > 1 needs ``parallelize_fn`` and strategy fsdp or hsdp."""
    parallelize_fn: Callable[..., Any] | None = None
    """Your hook ``fn(model, mesh, tp_mesh)``, called before trainstack shards the model: apply a tensor-parallel
    plan (``parallelize_module(model, tp_mesh, plan)``) or any change of your own; it may return a new model."""
    checkpoint_format: str = "auto"
    """``file`` (one file, rank 0 writes), ``sharded`` (a DCP folder, every rank writes its shard; resumes on any
    number of processes) or ``auto`` (sharded for fsdp/hsdp, file for ddp)."""
    async_checkpoint: bool = False
    """Sharded checkpoints only: write in the background; training waits only while the state is copied."""
    max_batches: int | None = None
    """Use at most this many batches per epoch. An endless loader (``to_dataloader(..., infinite=True)``) takes
    this many per epoch (1 when unset)."""
    fast_dev_run: int = 0
    """A smoke test of the whole loop before the real run (Lightning's): N optimizer steps, one validation on N
    batches and the final checkpoint, in a throw-away run folder that is deleted afterwards (True: 1; 0: off)."""
    resume: str | Path | None = None
    """``"auto"``: continue from the latest complete checkpoint of the run folder; a path: that checkpoint."""
    export_final_model: str | None = None
    """At the end of a finished run, the trained model's whole weights (gathered under FSDP) into ``<run
    folder>/export``: ``"safetensors"`` (``model.safetensors``, sharded with an index above 5 GB) or ``"hf"`` (a
    folder ``transformers``' ``from_pretrained`` loads: config + weights; a ``transformers`` model only)."""
    checkpoint_store: str | None = None
    """A URL (``s3://bucket/prefix``, ``gs://...``, any fsspec URL) the periodic checkpoints are also committed to:
    each is saved in the run folder as always, then uploaded off the training thread and committed with a marker;
    ``resume="auto"`` downloads the newest committed one when the run folder has none as new. Metrics and logs
    stay in the run folder. With ``create_subfolder_per_run`` the run folder's name is appended to the URL."""
    keep_last_checkpoints: int | None = None
    """Keep only the newest N periodic (resume) checkpoints (in the run folder and in ``checkpoint_store``). None:
    the newest 1 when a ``ModelCheckpoint`` keeps its own best files (Lightning's count: its top-k plus ``last``),
    else all. A callback's named files are kept separately."""
    stop_signals: tuple[str, ...] | None = None
    """Signals that request a graceful stop (checkpoint, then exit 0). None: ``TRAINSTACK_STOP_SIGNALS`` or SIGUSR2."""
    stop_file: Path | None = None
    """A file whose existence requests a graceful stop. None: ``TRAINSTACK_STOP_FILE`` (set by generated scripts)."""
    stop_check_every: int = 20
    """Poll for stop requests (signals, the stop file, Ctrl-C) every N optimizer steps -- one small all-reduce when
    distributed -- and at every epoch end."""
    hang_timeout: float | None = None
    """Seconds without progress on every rank before the hang watchdog dumps every rank's stacks into the run folder
    (``hang-<id>/``), names the rank that is behind, and exits (code 124) so the job can be restarted. Three times
    as long before the first step and during checkpoints. None: ``TRAINSTACK_HANG_TIMEOUT`` or 600; 0: off."""
    stop_on_nonfinite: bool = True
    """Stop when an epoch's training loss is NaN or infinite (checked on the epoch mean: no extra sync); the last
    finite checkpoint is kept. False: train on."""

    def __post_init__(self) -> None:
        """Every field checked by its owner, a message naming the field: the run's folders and sizes here, the
        cadence by the ``Schedule``, checkpoints and the store by ``runstore``, the parallel plan by
        ``Parallelism``, the graceful stop by the stopper."""
        compile_options(self.compile, "TrainConfig.compile")
        self.root_folder = _as_path("root_folder", self.root_folder)
        self.log_folder = _as_path("log_folder", self.log_folder)
        for name in ("nprocs", "batch_size", "gradient_accumulation_steps", "stop_check_every"):
            check_int(name, getattr(self, name), minimum=1)
        if self.seed_every_step and self.seed is None:
            raise ConfigError("seed_every_step=True needs a seed: the streams of each step derive from it. HINT: "
                              "seed=0 (or any int), or seed_every_step=False.")
        for name in ("max_batches", "keep_last_checkpoints", "seed"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=0 if name == "seed" else 1)
        if self.hang_timeout is not None and (isinstance(self.hang_timeout, bool) or not isinstance(
                self.hang_timeout, (int, float)) or self.hang_timeout < 0):
            raise ConfigError(f"TrainConfig.hang_timeout={self.hang_timeout!r} must be a number of seconds >= 0 (0 "
                              f"turns the hang watchdog off) or None.")
        if self.batch_size != 1:
            warnings.warn(f"TrainConfig.batch_size={self.batch_size} is not used (nor was it by qadence): the "
                          f"DataLoader's batch_size decides.", stacklevel=3)
        if self.stop_file is not None:
            self.stop_file = _as_path("stop_file", self.stop_file)
        if self.stop_signals is not None:
            from ._runtime.preemption import resolve_signals

            resolve_signals(self.stop_signals)  # a plain string is refused before it could become characters
            self.stop_signals = tuple(self.stop_signals)
        if isinstance(self.fast_dev_run, bool):  # Lightning's spelling: True is one step
            self.fast_dev_run = int(self.fast_dev_run)
        check_int("fast_dev_run", self.fast_dev_run, minimum=0)
        self._check_choices()
        self._check_callables()
        schedule.check(self)
        self.checkpoint_store = runstore.check(self)
        if self.resume is False:  # type: ignore[comparison-overlap]  # qadence-style "off"
            self.resume = None
        if self.create_subfolder_per_run and self.log_folder != Path("./"):
            raise ConfigError(f"TrainConfig.log_folder={str(self.log_folder)!r} and create_subfolder_per_run=True "
                              f"contradict each other: pick one run folder or a new subfolder of root_folder per run.")
        self.fsdp_blocks = Parallelism(self.hsdp_replicas, self.tensor_parallel_size, self.parallelize_fn,
                                       self.activation_checkpointing).check_config(
            self.strategy, self.fsdp_blocks, self.fsdp_min_params)
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
        if self.resume not in (None, False, "auto") and isinstance(self.resume, (str, os.PathLike)):
            _not_a_url("resume", self.resume)

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

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (loadable with ``torch.load(weights_only=True)``): functions become their names."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    # ------------------------------------------------------------------ files and the command line
    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """A config from a YAML, TOML or JSON file of field values (``overrides`` win); unknown keys and bad values
        are the same ``ConfigError`` as in code."""
        return cls(**{**configread.read_settings(Path(path), _from_file_value), **overrides})

    def to_file(self, path: str | os.PathLike) -> Path:
        """Write the plain fields (not functions or callbacks) as YAML (``.yaml``/``.yml``) or JSON, atomically; what
        ``from_file`` reads back."""
        return configread.write_settings(Path(path), {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                                                      if f.name in _FILE_FIELDS})

    @overload
    @classmethod
    def from_cli(cls, argv: list[str] | None = None, *, options: None = None, **defaults: Any) -> TrainConfig: ...

    @overload
    @classmethod
    def from_cli(cls, argv: list[str] | None = None, *, options: dict[str, Any],
                 **defaults: Any) -> tuple[TrainConfig, SimpleNamespace]: ...

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, *, options: dict[str, Any] | None = None,
                 **defaults: Any) -> TrainConfig | tuple[TrainConfig, SimpleNamespace]:
        """A config from the command line: ``--<field> value`` for every plain field (``--max-iter 5`` or
        ``--max_iter=5``; a boolean also as ``--verbose`` / ``--no-verbose``; ``--config FILE`` reads a
        YAML/TOML/JSON file). ``defaults`` are the script's own; a file wins over them, the command line over both.

        ``options`` are the script's own settings with their defaults (``options={"lr": 3e-3, "hidden": 64}``): they
        are options too (``--lr 1e-3``, typed as their defaults), listed by ``--help``, and come back as a namespace
        -- ``config, opts = TrainConfig.from_cli(options={...})`` -- so ``trainstack submit --sweep lr=...`` needs no
        parser of yours. Any other argument is an error naming the closest option; ``--help`` lists every option
        and exits."""
        config, rest = cls.parse_cli(argv, **defaults)
        own = dict(options or {})
        if "--help" in rest or "-h" in rest:
            print(cli_usage(config, own))
            raise SystemExit(0)
        values = configread.parse_options(own, rest, _suggestion)
        return (config, SimpleNamespace(**values)) if options is not None else config

    @classmethod
    def parse_cli(cls, argv: list[str] | None = None, **defaults: Any) -> tuple[TrainConfig, list[str]]:
        """Like ``from_cli``, but arguments that are not fields come back, in order, for the script's own parser:
        ``config, rest = TrainConfig.parse_cli()``."""
        args = list(sys.argv[1:] if argv is None else argv)
        cli: dict[str, Any] = {}
        from_file: dict[str, Any] = {}
        rest: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            name, eq, value = word[2:].partition("=")
            name = name.replace("-", "_")
            negated = name.startswith("no_") and _is_bool(name[3:])
            if not word.startswith("--") or (name not in _FILE_FIELDS and name != "config" and not negated):
                rest.append(word)
                if word.startswith("--") and not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                    rest.append(args[i + 1])  # its value
                    i += 1
                i += 1
                continue
            if negated:
                name, value = name[3:], "false"
            elif not eq:
                if _is_bool(name) and (i + 1 >= len(args) or args[i + 1].startswith("--")):
                    value = "true"
                elif i + 1 >= len(args):
                    raise ConfigError(f"TrainConfig.from_cli: --{name} needs a value.")
                else:
                    value, i = args[i + 1], i + 1
            if name == "config":
                from_file = configread.read_settings(Path(value), _from_file_value)
            else:
                cli[name] = _parse_value(name, value)
            i += 1
        return cls(**{**defaults, **from_file, **cli}), rest

    @classmethod
    def field_docs(cls) -> dict[str, tuple[str, str]]:
        """``{field: (default, doc)}`` for every field, from the class source (the docs' table, ``help()``)."""
        return dict(_FIELD_DOCS)

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
        _not_a_url(name, value)
        return Path(value)
    raise ConfigError(f"TrainConfig.{name}={value!r} must be a path (str or pathlib.Path).")


def _not_a_url(name: str, value: str | os.PathLike) -> None:
    """An ``s3://`` (any URL) path is refused, never reinterpreted as a local folder named ``s3:``."""
    scheme = url_scheme(value)
    if scheme:
        raise ConfigError(f"TrainConfig.{name}={str(value)!r} is a {scheme}:// URL, but run folders and checkpoints "
                          f"are written to a file system: it would become a local folder named '{scheme}:'. HINT: "
                          f"give a path on a local or shared file system for the run folder and "
                          f"checkpoint_store={str(value)!r} to commit the checkpoints there too.")


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


# ---------------------------------------------------------------------------------------------------- unknown fields
_SYNONYMS = {"max_epochs": "max_iter (epochs) or max_steps (optimizer steps)", "epochs": "max_iter",
             "num_epochs": "max_iter", "max_iters": "max_iter", "lr": "the optimizer's lr (torch.optim.SGD(lr=...))",
             "learning_rate": "the optimizer's lr (torch.optim.SGD(lr=...))", "devices": "nprocs",
             "num_processes": "nprocs", "world_size": "nprocs", "precision": "mixed_precision",
             "accumulate_grad_batches": "gradient_accumulation_steps", "gradient_clip_val": "grad_clip_norm",
             "val_check_interval": "val_every_n_steps", "check_val_every_n_epoch": "val_every",
             "default_root_dir": "root_folder", "ckpt_path": "resume", "limit_train_batches": "max_batches"}


def _suggestion(name: str) -> str:
    import difflib

    if name in _SYNONYMS:
        return f". HINT: use {_SYNONYMS[name]}."
    close = difflib.get_close_matches(name, [f.name for f in fields(TrainConfig)], n=2, cutoff=0.6)
    return f". HINT: did you mean {' or '.join(close)}?" if close else \
        ". HINT: help(TrainConfig) lists every field with its default."


def _checked_init(init: Any) -> Any:
    """Wrap the generated ``__init__``: an unknown keyword is a ConfigError naming the nearest field (Python's own
    error is a bare TypeError), a positional argument a ConfigError too."""
    import functools

    names = {f.name for f in fields(TrainConfig)}

    @functools.wraps(init)
    def __init__(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        if args:
            raise UnknownField(f"TrainConfig takes keyword arguments only, got {len(args)} positional (e.g. "
                              f"TrainConfig(max_iter=10)).")
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise UnknownField(f"TrainConfig has no field {unknown[0]!r}{_suggestion(unknown[0])}")
        init(self, **kwargs)

    return __init__


TrainConfig.__init__ = _checked_init(TrainConfig.__init__)  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------- files, CLI
#: Fields a file or the command line can set: plain values (not functions, callbacks or figures).
_FILE_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name not in (
    "validation_criterion", "trainstop_criterion", "callbacks", "plotting_functions"))


def cli_fields() -> tuple[str, ...]:
    """The fields a file or the command line can set (plain values: not functions, callbacks or figures)."""
    return _FILE_FIELDS


def cli_usage(config: TrainConfig, own: dict[str, Any] | None = None) -> str:
    """``--help`` of ``TrainConfig.from_cli``: the script's own options, then every field with this run's value and
    its doc's first line."""
    lines = []
    if own:
        lines.append("the script's options:")
        lines += [f"  {f'--{name} {value!r}':<40} ({type(value).__name__})" for name, value in own.items()]
    lines.append("options (every TrainConfig field; --config FILE reads YAML/TOML/JSON, the command line wins):")
    for name, (_default, doc) in _FIELD_DOCS.items():
        if name in _FILE_FIELDS:
            first = doc.split(". ")[0].rstrip(".")
            option = f"--{name} {_plain(getattr(config, name))!r}"
            lines.append(f"  {option:<40} {first}")
    return "\n".join(lines)


def _from_file_value(name: str, value: Any) -> Any:
    if name == "dtype" and isinstance(value, str):
        return _parse_value(name, value)
    if name in ("fsdp_blocks", "stop_signals") and isinstance(value, list):
        return tuple(value)
    return value


def _is_bool(name: str) -> bool:
    return name in _FILE_FIELDS and str(next(f for f in fields(TrainConfig) if f.name == name).type) == "bool"


def _parse_value(name: str, text: str) -> Any:
    """A command-line string as the field's type (ints, floats, booleans, None, paths, dtypes, tuples)."""
    default = next(f for f in fields(TrainConfig) if f.name == name)
    kind = str(default.type)
    lowered = text.strip().lower()
    if lowered in ("none", "null") and "None" in kind:
        return None
    try:
        if name == "compile" and lowered.startswith("{"):
            return json.loads(text)
        if kind.startswith("bool"):
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float") or name == "hang_timeout":
            return float(text)
        if name == "dtype":
            value = getattr(torch, text.replace("torch.", ""), None)
            if not isinstance(value, torch.dtype):
                raise ValueError(text)
            return value
        if name in ("fsdp_blocks", "stop_signals"):
            return tuple(part.strip() for part in text.split(",") if part.strip())
        if name == "hyperparams":
            return json.loads(text)
    except ValueError:
        raise ConfigError(f"TrainConfig.{name}={text!r} is not a valid {kind} value.") from None
    return text


def _field_docs() -> dict[str, tuple[str, str]]:
    """Every field's default (as written in the source) and docstring, read from this file once."""
    import ast

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    out: dict[str, tuple[str, str]] = {}
    body = cls.body
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            default = ast.unparse(node.value) if node.value is not None else ""
            if isinstance(node.value, ast.Name):  # a named constant (one place for the default): its value
                default = repr(globals()[node.value.id])
            out[node.target.id] = (default.replace("field(default_factory=list)", "[]").replace(
                "field(default_factory=dict)", "{}"), " ".join(str(doc).split()))
    return out


_FIELD_DOCS = _field_docs()
TrainConfig.__doc__ = (TrainConfig.__doc__ or "") + "\n\nFields (default: meaning):\n\n" + "\n".join(
    f"    {name} = {default}\n        {doc}" for name, (default, doc) in _FIELD_DOCS.items())

"""HF Accelerate's constructor options, checked once with messages naming the option, and resolved to the values
the Accelerator keeps (the plugin/config objects win over the plain keywords they replace; both at once is an
error, not a silent choice)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from .._common.choices import MIXED_PRECISION, TRACKING_TOOLS
from ..errors import ConfigError
from .config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)

__all__ = ["AccelerateOptions"]

RNG_TYPES = ("generator", "torch", "cuda")
_TRACKER_PACKAGES = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


@dataclasses.dataclass
class AccelerateOptions:
    """The Accelerate options of one Accelerator, checked."""

    device_placement: bool
    mixed_precision: str
    gradient_accumulation_steps: int
    gradient_accumulation_plugin: GradientAccumulationPlugin
    log_with: tuple[str, ...] | None
    project_dir: str | None
    project_config: ProjectConfiguration
    dataloader_config: DataLoaderConfiguration
    rng_types: list[str]
    handlers: Handlers

    @classmethod
    def check(cls, *, device_placement: bool, mixed_precision: str | None, gradient_accumulation_steps: int,
              log_with: str | Sequence[str] | None, project_dir: Any, dataloader_config: Any,
              gradient_accumulation_plugin: Any, project_config: Any, kwargs_handlers: Any, rng_types: Any,
              step_scheduler_with_optimizer: bool, use_cuda: bool) -> AccelerateOptions:
        precision = _mixed_precision(mixed_precision)
        plugin = _accumulation(gradient_accumulation_steps, gradient_accumulation_plugin)
        config = _project(project_dir, project_config)
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration()
        elif not isinstance(dataloader_config, DataLoaderConfiguration):
            raise ConfigError(f"dataloader_config={dataloader_config!r}: must be a DataLoaderConfiguration "
                              f"(from trainstack.utils import DataLoaderConfiguration).")
        if not isinstance(step_scheduler_with_optimizer, bool):
            raise ConfigError(f"step_scheduler_with_optimizer={step_scheduler_with_optimizer!r}: must be True or "
                              f"False.")
        return cls(device_placement=bool(device_placement), mixed_precision=precision,
                   gradient_accumulation_steps=int(plugin.num_steps or 1), gradient_accumulation_plugin=plugin,
                   log_with=_trackers(log_with), project_dir=config.project_dir, project_config=config,
                   dataloader_config=dataloader_config, rng_types=_rng_types(rng_types, use_cuda),
                   handlers=Handlers.of(kwargs_handlers))


def _mixed_precision(value: str | None) -> str:
    """None means Accelerate's default: ``ACCELERATE_MIXED_PRECISION`` (``accelerate launch`` sets it), else no."""
    where = "mixed_precision"
    if value is None:
        value, where = os.environ.get("ACCELERATE_MIXED_PRECISION", "no"), "ACCELERATE_MIXED_PRECISION"
    if value not in MIXED_PRECISION or value == "fp8":  # the Accelerate loop autocasts: fp8 is a model change
        hint = (" (for float8 Linear layers through torchao on GPUs of compute capability >= 8.9: "
                "Accelerator(float8=True, mixed_precision='bf16'), or TrainConfig(mixed_precision='fp8'))") \
            if value == "fp8" else ""
        raise ConfigError(f"{where}={value!r}: must be 'no', 'fp16' or 'bf16'{hint}.")
    return value


def _accumulation(steps: int, plugin: Any) -> GradientAccumulationPlugin:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"gradient_accumulation_steps={steps!r}: must be an integer >= 1.")
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=steps)
    if not isinstance(plugin, GradientAccumulationPlugin):
        raise ConfigError(f"gradient_accumulation_plugin={plugin!r}: must be a GradientAccumulationPlugin.")
    if steps != 1:
        raise ConfigError("gradient_accumulation_steps and gradient_accumulation_plugin were both given. HINT: give "
                          "one: GradientAccumulationPlugin(num_steps=...) holds the steps.")
    if plugin.num_steps is None:
        plugin = dataclasses.replace(plugin, num_steps=int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                                          "1")))
    return plugin


def _project(project_dir: Any, config: Any) -> ProjectConfiguration:
    if config is None:
        return ProjectConfiguration(project_dir=None if project_dir is None else str(project_dir))
    if not isinstance(config, ProjectConfiguration):
        raise ConfigError(f"project_config={config!r}: must be a ProjectConfiguration.")
    if project_dir is not None:
        if config.project_dir is not None and str(project_dir) != str(config.project_dir):
            raise ConfigError(f"project_dir={str(project_dir)!r} and project_config.project_dir="
                              f"{config.project_dir!r} differ. HINT: give the folder once.")
        config.set_directories(project_dir)
    return config


def _trackers(log_with: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``None``, one tracker, a list, or ``"all"`` (every one whose package is installed)."""
    if log_with is None:
        return None
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    if "all" in names:
        return ("jsonl", *[t for t, pkg in _TRACKER_PACKAGES.items() if _importable(pkg)])
    bad = [n for n in names if n not in TRACKING_TOOLS]
    if bad:
        raise ConfigError(f"log_with={log_with!r}: {bad[0]!r} is not a tracker trainstack writes; choose from "
                          f"{', '.join(TRACKING_TOOLS)} or 'all' (comet_ml, aim, clearml, dvclive, swanlab: not "
                          f"supported; metrics.jsonl is always written).")
    return tuple(dict.fromkeys(names))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _rng_types(rng_types: Any, use_cuda: bool) -> list[str]:
    """Accelerate's default synchronises the loaders' generators; ``torch``/``cuda`` are accepted too."""
    if rng_types is None:
        return ["generator"]
    names = [str(r.value if hasattr(r, "value") else r) for r in rng_types]
    bad = [n for n in names if n not in RNG_TYPES or (n == "cuda" and not use_cuda)]
    if bad:
        raise ConfigError(f"rng_types={list(rng_types)!r}: {bad[0]!r} is not a random generator trainstack syncs "
                          f"here; choose from {', '.join(RNG_TYPES)} ('cuda' on GPUs only).")
    return names


@dataclasses.dataclass
class Handlers:
    """The ``kwargs_handlers`` an Accelerator was given, one of each kind (defaults where none was)."""

    ddp: DistributedDataParallelKwargs = dataclasses.field(default_factory=DistributedDataParallelKwargs)
    scaler: GradScalerKwargs = dataclasses.field(default_factory=GradScalerKwargs)
    profile: ProfileKwargs = dataclasses.field(default_factory=ProfileKwargs)
    autocast: AutocastKwargs = dataclasses.field(default_factory=AutocastKwargs)
    process_group: InitProcessGroupKwargs = dataclasses.field(default_factory=InitProcessGroupKwargs)

    @property
    def timeout_s(self) -> float | None:
        """The collective timeout the program chose, in seconds (None: the environment's or the default)."""
        timeout = self.process_group.timeout
        return timeout.total_seconds() if timeout is not None else None

    @classmethod
    def of(cls, handlers: Any) -> Handlers:
        """Sort ``handlers`` by kind; a kind trainstack does not take is refused, naming it."""
        found = cls()
        kinds = {DistributedDataParallelKwargs: "ddp", GradScalerKwargs: "scaler", ProfileKwargs: "profile",
                 AutocastKwargs: "autocast"}
        for handler in handlers or ():
            if isinstance(handler, InitProcessGroupKwargs):
                _process_group(handler)
                found.process_group = handler
                continue
            kind = kinds.get(type(handler))
            if kind is None:
                raise ConfigError(f"kwargs_handlers: {type(handler).__name__} is not supported by trainstack; it "
                                  f"takes {', '.join(k.__name__ for k in kinds)} and InitProcessGroupKwargs(timeout=).")
            setattr(found, kind, handler)
        return found


def _process_group(handler: InitProcessGroupKwargs) -> None:
    if handler.backend is not None or handler.init_method is not None:
        raise ConfigError("InitProcessGroupKwargs(backend=/init_method=): trainstack joins the group itself. HINT: "
                          "Accelerator(backend='gloo'|'nccl'); InitProcessGroupKwargs(timeout=...) is taken.")

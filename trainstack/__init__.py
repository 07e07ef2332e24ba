"""trainstack: one PyTorch training script from a laptop to a multi-node Slurm cluster."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .accelerator import Accelerator, seed_everything
from .callbacks import Callback
from .config import TrainConfig
from .errors import ConfigError, LaunchError, TrainstackError, WorkerError
from .steps import optimize_step
from .trainer import Trainer

try:
    __version__ = version("trainstack")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0"

__all__ = [
    "Accelerator",
    "Trainer",
    "TrainConfig",
    "Callback",
    "optimize_step",
    "seed_everything",
    "TrainstackError",
    "ConfigError",
    "LaunchError",
    "WorkerError",
    "__version__",
]

"""trainstack: one PyTorch training script from a laptop to a multi-node Slurm cluster.

Names are imported lazily (PEP 562) so that ``trainstack generate`` and ``trainstack --help`` never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__  # a plain constant: importlib.metadata costs ~0.1 s at CLI start-up

_LAZY = {
    "Accelerator": "accelerator", "seed_everything": "accelerator", "Trainer": "trainer",
    "TrainConfig": "config", "Callback": "callbacks", "optimize_step": "steps",
    "TrainstackError": "errors", "ConfigError": "errors", "LaunchError": "errors", "WorkerError": "errors",
    "LaunchSpec": "render", "render": "render", "submit": "submit",
}

__all__ = ["Accelerator", "Trainer", "TrainConfig", "Callback", "optimize_step", "seed_everything", "LaunchSpec",
           "render", "submit", "TrainstackError", "ConfigError", "LaunchError", "WorkerError", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .accelerator import Accelerator, seed_everything
    from .callbacks import Callback
    from .config import TrainConfig
    from .errors import ConfigError, LaunchError, TrainstackError, WorkerError
    from .render import LaunchSpec, render
    from .steps import optimize_step
    from .submit import submit
    from .trainer import Trainer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainstack' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

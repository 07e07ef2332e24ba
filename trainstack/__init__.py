"""trainstack: one PyTorch training script from a laptop to a multi-node Slurm cluster.

The public surface is ``__all__``; errors live in ``trainstack.errors``. Names are imported lazily (PEP 562) so
that ``trainstack generate`` and ``trainstack --help`` never import torch.

For code moving over from ``qadence.ml_tools``, the old import paths keep working with the package name replaced:
``trainstack.train_utils.Accelerator``, ``trainstack.trainer.Trainer``, ``trainstack.optimize_step.optimize_step``,
and ``DictDataLoader``, ``to_dataloader``, ``InfiniteTensorDataset``, ``OptimizeResult``, ``load_checkpoint``,
``write_checkpoint`` from ``trainstack`` itself (see docs/migrating-from-qadence.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# `render` and `submit` are both modules and the functions in them. The modules are callable (they call the
# function), so `from trainstack import render` and `import trainstack.render` give one object that works both
# ways, whatever was imported first (a lazy name would lose to the submodule the import system sets).
from . import (
    render,
    submit,  # noqa: E402  (torch-free and cheap)
)
from ._common.version import __version__  # a plain constant: importlib.metadata costs ~0.1 s at CLI start-up
from .render import LaunchSpec  # noqa: E402

__all__ = ["Accelerator", "Trainer", "TrainConfig", "Callback", "optimize_step", "seed_everything", "LaunchSpec",
           "render", "submit", "__version__"]

_LAZY = {
    "Accelerator": "accelerator", "seed_everything": "accelerator", "Trainer": "trainer",
    # HF Accelerate's and nntool's names (importable for drop-in code, not advertised)
    "notebook_launcher": "accelerator", "debug_launcher": "accelerator", "set_seed": "accelerator",
    "slurm_fn": "slurm", "SlurmConfig": "slurm",
    "PartialState": "state", "AcceleratorState": "state", "DistributedType": "state",
    "DataLoaderConfiguration": "utils", "GradientAccumulationPlugin": "utils", "ProjectConfiguration": "utils",
    "DistributedDataParallelKwargs": "utils", "GradScalerKwargs": "utils", "InitProcessGroupKwargs": "utils",
    "find_executable_batch_size": "utils", "synchronize_rng_states": "utils", "skip_first_batches": "data_loader",
    "TrainConfig": "config", "Callback": "callbacks", "optimize_step": "_train.steps",
    # qadence.ml_tools names (importable, not advertised) and the errors' old home
    "DictDataLoader": "data", "to_dataloader": "data", "InfiniteTensorDataset": "data",
    "OptimizeResult": "callbacks", "load_checkpoint": "checkpoint", "write_checkpoint": "checkpoint",
    "TrainstackError": "errors", "ConfigError": "errors", "LaunchError": "errors", "WorkerError": "errors",
}

if TYPE_CHECKING:  # pragma: no cover
    from ._train.steps import optimize_step
    from .accelerator import Accelerator, seed_everything
    from .accelerator import notebook_launcher as notebook_launcher
    from .accelerator import set_seed as set_seed
    from .callbacks import Callback
    from .config import TrainConfig
    from .slurm import SlurmConfig as SlurmConfig
    from .slurm import slurm_fn as slurm_fn
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

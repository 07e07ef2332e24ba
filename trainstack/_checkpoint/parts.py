"""The state of a checkpoint's parts: a model's (unwrapped from DDP: checkpoints hold the plain module's keys),
an optimizer's, a scheduler's -- whatever has ``state_dict``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap", "state_of"]


def unwrap(model: Any) -> Any:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


def state_of(part: Any) -> Any:
    if part is None:
        return None
    if isinstance(part, torch.nn.Module):
        return unwrap(part).state_dict()
    return part.state_dict()

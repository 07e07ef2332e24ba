"""A checkpoint's parts -- a model (unwrapped from DDP: checkpoints hold the plain module's keys), an optimizer, a
scheduler, whatever has ``state_dict`` --: their state, loading it back, and what a restore found (``Restored``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = ["unwrap", "state_of", "Restored", "load_parts", "model_config"]


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


@dataclass
class Restored:
    """What ``Checkpointer.restore`` found: the counters, this rank's RNG state (None when the checkpoint was
    written by another number of processes) and the file."""

    counters: dict[str, Any]
    rng: dict[str, Any] | None
    path: Path
    world_size: int
    source: str = ""  # in words, when not the file itself: "memory at step 40 (...)"
    origin: str = "checkpoint"  # checkpoint, memory (peer copies in /dev/shm) or live (a survivor's own state)


def load_parts(parts: Mapping[str, Any], state: Mapping[str, Any], where: Path) -> None:
    for name, part in parts.items():
        if part is not None and state.get(name) is not None:
            _load_part(name, part, state, where)


def _load_part(name: str, part: Any, state: Mapping[str, Any], where: Path) -> None:
    saved = state[name]
    if name == "optimizer" and state.get("optimizer_class") not in (None, type(part).__name__):
        raise CheckpointError(f"{where} holds the state of a {state['optimizer_class']} optimizer, but this run uses "
                              f"{type(part).__name__}. HINT: resume with the same optimizer, or start a new run "
                              f"(another log_folder, or resume=None).")
    try:
        if isinstance(part, torch.nn.Module):
            unwrap(part).load_state_dict(saved)
        else:
            part.load_state_dict(saved)
    except (RuntimeError, KeyError, ValueError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # torch: a heading, then the details
        raise CheckpointError(f"{where} does not fit this run's {name}: {first.rstrip('.')}. HINT: a checkpoint only "
                              f"loads into the same model and optimizer it was written from; start a new run "
                              f"(another log_folder, or resume=None) after changing them.") from exc


def model_config(model: Any) -> dict[str, Any] | None:
    """A Hugging Face ``transformers`` model's config (a plain dict), kept in checkpoints so that
    ``trainstack checkpoint export --format hf`` can rebuild the model; None for any other model."""
    plain = unwrap(model) if model is not None else None
    config = getattr(plain, "config", None)
    if config is None or not type(config).__module__.startswith("transformers") \
            or not hasattr(config, "to_json_string"):
        return None
    found = json.loads(config.to_json_string(use_diff=False))
    found["architectures"] = found.get("architectures") or [type(plain).__name__]  # as save_pretrained records it
    return found

"""Reading one checkpoint, trusting nothing in it: its names (``ckpt-e<epoch>-s<step>[.pt]``, ``best``), the
complete periodic ones of a folder, a file or sharded folder loaded with ``weights_only`` (a FIFO, a foreign or
damaged file, an incomplete sharded save each a clear error), and whether it fits a model before any process
starts. What the ``trainstack.checkpoint`` door's Checkpointer and tools read with."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UnreadableCheckpoint
from .failures import why_unreadable
from .parts import unwrap

__all__ = ["FORMAT_VERSION", "PATTERN", "BEST", "BEST_SHARDED", "SAVE_STATE", "checkpoint_name", "step_of", "periodic",
           "load_file", "check_fits"]

FORMAT_VERSION = 1
PATTERN = re.compile(r"^ckpt-e(\d+)-s(\d+)(\.pt)?$")
BEST = "best.pt"
BEST_SHARDED = "best"
SAVE_STATE = "save_state"  # `saved_by` of Accelerator.save_state's checkpoints: they may hold no model


def checkpoint_name(epoch: int, global_step: int) -> str:
    return f"ckpt-e{epoch:05d}-s{global_step:09d}.pt"


def step_of(path: str | os.PathLike) -> int:
    """The global step in a periodic checkpoint's name (``ckpt-e<epoch>-s<step>``); -1 for any other name."""
    m = PATTERN.match(Path(path).name)
    return int(m.group(2)) if m else -1


def periodic(folder: Path) -> list[Path]:
    """The complete periodic checkpoints of ``folder`` (files, and sharded folders with their commit marker), oldest
    first."""
    from .sharded import is_complete

    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = PATTERN.match(p.name)
        if m and (p.is_file() if m.group(3) else is_complete(p)):
            found.append(((int(m.group(2)), int(m.group(1))), p))
    return [p for _, p in sorted(found)]


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint (a file, or a sharded folder's non-tensor part) to the CPU with ``weights_only=True``; a
    clear error for missing or foreign files."""
    from .sharded import EXTRAS, DamagedCheckpoint, is_complete, verify

    path = Path(path)
    if path.is_dir() and is_complete(path):
        try:
            verify(path)
        except DamagedCheckpoint as exc:
            raise UnreadableCheckpoint(f"checkpoint {path} is damaged: {exc}") from None
        return _checked(path / EXTRAS, path)
    if path.is_dir() and (path / EXTRAS).exists():
        raise CheckpointError(f"{path} is an incomplete sharded checkpoint (no COMMITTED marker: its save was "
                              f"interrupted). HINT: resume='auto' uses the newest complete one.")
    if path.is_dir():
        run = path.parent if path.name == "checkpoints" else path
        newest = periodic(run / "checkpoints")
        latest = newest[-1] if newest else None
        hint = f" (its newest checkpoint is {latest})" if latest else ""
        raise CheckpointError(f"resume={str(path)!r} is a folder{hint}; a path must point at one ckpt-*.pt file. "
                              f"HINT: resume='auto' continues from the newest checkpoint of the run folder.")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist. HINT: resume='auto' picks the latest one "
                              f"in the run folder; a path must point at a ckpt-* file or folder.")
    state = _checked(path, path)
    if not isinstance(state.get("model"), Mapping) and state.get("saved_by") != SAVE_STATE:
        raise UnreadableCheckpoint(f"{path} is a trainstack checkpoint without a model state: it cannot restore "
                                   f"a run (written by another tool?).")
    return state


def _checked(file: Path, name: Path) -> dict[str, Any]:
    if not file.is_file():  # a FIFO or device would block torch.load forever
        raise UnreadableCheckpoint(f"checkpoint {file} is not a regular file.")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UnreadableCheckpoint(f"cannot load checkpoint {name}: {why_unreadable(exc, file)}.") from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise UnreadableCheckpoint(f"{name} is not a trainstack checkpoint (format {FORMAT_VERSION}).")
    return state


def check_fits(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Compare a checkpoint's parameter names and shapes with ``model`` (cheap: no tensor is read), so a resume
    into another model fails before any process starts, naming the first difference."""
    where = Path(path)
    if where.is_dir():
        from .sharded import DamagedCheckpoint, verify

        try:
            meta = verify(where).state_dict_metadata
        except DamagedCheckpoint as exc:
            raise UnreadableCheckpoint(f"checkpoint {where} is damaged: {exc}") from None
        saved = {k[len("model."):]: tuple(v.size) for k, v in meta.items() if k.startswith("model.")
                 and hasattr(v, "size")}
    else:
        if not where.is_file():
            raise UnreadableCheckpoint(f"checkpoint {where} is not a regular file.")
        try:
            state = torch.load(where, map_location="cpu", weights_only=True, mmap=True)
            saved = {k: tuple(v.shape) for k, v in state["model"].items()}
        except Exception as exc:
            raise UnreadableCheckpoint(f"cannot read checkpoint {where}: the file is damaged or not a trainstack "
                                       f"checkpoint ({type(exc).__name__}: {exc}).") from None
    mine = {k: tuple(v.shape) for k, v in unwrap(model).state_dict().items()}
    for key in sorted(set(saved) | set(mine)):
        if saved.get(key) != mine.get(key):
            raise CheckpointError(f"{where} does not fit this run's model: {key} is {saved.get(key, 'missing')} in "
                                  f"the checkpoint and {mine.get(key, 'missing')} in the model. HINT: a checkpoint "
                                  f"only loads into the model it was written from; start a new run (another "
                                  f"log_folder, or resume=None) after changing the model.")

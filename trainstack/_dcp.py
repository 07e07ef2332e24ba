"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): a folder per checkpoint, every rank writes its
own shard of the model and optimizer, and the checkpoint counts only once it is complete.

    checkpoints/ckpt-e00005-s000000100/      the final name appears only when committed
        .metadata, __<rank>_0.distcp         DCP: model + optimizer (sharded or replicated, any strategy)
        trainstack.pt                        counters, scheduler, scaler, callbacks, RNG of every rank, config
        COMMITTED                            written last

A save goes to ``.ckpt-...tmp-0/``; rank 0 writes ``trainstack.pt`` and ``COMMITTED`` after every rank's shard is on
disk (DCP's coordinator writes ``.metadata`` only then), then renames the folder. A crash or SIGKILL at any point
leaves at most a temp folder, removed when the next run starts. Loading reshards: a checkpoint written by N ranks
loads on any number of ranks (one included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._files import fsync_path

__all__ = ["MARKER", "EXTRAS", "write", "finish", "read_extras", "load_into", "is_complete", "tensors", "Pending",
           "size_on_disk"]

MARKER = "COMMITTED"
EXTRAS = "trainstack.pt"


def is_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / MARKER).exists()


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-0")


def _state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


@dataclass
class Pending:
    """An asynchronous save in flight: its future, and what committing it needs."""

    future: Any
    temp: Path
    final: Path
    started: float


def write(final: Path, model: Any, optimizer: Any, extras: Mapping[str, Any], is_main: bool,
          async_group: Any = None) -> Path | Pending:
    """Collective: write the shards of ``model``/``optimizer`` and rank 0's ``extras``. With ``async_group`` (a
    separate gloo process group) only staging happens now and a :class:`Pending` is returned; :func:`finish`
    commits it."""
    import torch.distributed.checkpoint as dcp

    temp = _temp_name(final)
    if is_main:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        torch.save(dict(extras), temp / EXTRAS)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the folder exists before any rank writes into it
    state = _state(model, optimizer)
    if async_group is not None:
        return Pending(dcp.async_save(state, checkpoint_id=str(temp), process_group=async_group), temp, final,
                       time.perf_counter())
    with _single_process():
        dcp.save(state, checkpoint_id=str(temp))
    return _commit(temp, final, is_main)


def finish(pending: Pending, is_main: bool) -> Path:
    """Wait for an asynchronous save and commit it (rank 0: its DCP future completes after every shard)."""
    pending.future.result()
    return _commit(pending.temp, pending.final, is_main)


def _commit(temp: Path, final: Path, is_main: bool) -> Path:
    if is_main:
        marker = temp / MARKER
        marker.write_text(time.strftime("%Y-%m-%d %H:%M:%S"))
        fsync_path(marker)
        if final.exists():
            shutil.rmtree(final)
        os.replace(temp, final)
        fsync_path(final.parent)
    return final



def read_extras(folder: Path) -> dict[str, Any]:
    return torch.load(folder / EXTRAS, map_location="cpu", weights_only=True)


def load_into(folder: Path, model: Any, optimizer: Any) -> None:
    """Load the model (and optimizer) shards into live objects, resharded to this run's layout (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    with _single_process():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not (dist.is_available() and dist.is_initialized()))
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def tensors(folder: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` (``model``, ``optimizer``) of a sharded checkpoint, whole, in this one process
    (no process group): keys as DCP flattens them, without the prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata):
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if template:
        with _single_process():
            dcp.load(template, checkpoint_id=str(folder), no_dist=True)
    return {key[len(prefix) + 1:]: value for key, value in template.items()}


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it 'assumes' one process even when told so (no_dist=True); that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
        yield


def size_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

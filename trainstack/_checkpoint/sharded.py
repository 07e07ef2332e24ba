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
import io
import os
import pickle
import shutil
import stat
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._common.files import fsync_path, temp_path
from ..errors import CheckpointError, UnreadableCheckpoint

__all__ = ["MARKER", "EXTRAS", "load_checked", "write", "finish", "read_extras", "load_into", "is_complete", "tensors",
           "Pending", "size_on_disk", "read_metadata", "verify", "DamagedCheckpoint"]

MARKER = "COMMITTED"
EXTRAS = "trainstack.pt"


def is_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / MARKER).exists()


def temp_name(final: Path) -> Path:
    return temp_path(final, owner=0)  # one folder every rank writes into


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
    separate gloo process group) only staging happens now and a ``Pending`` is returned; ``finish``
    commits it."""
    import torch.distributed.checkpoint as dcp

    temp = temp_name(final)
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
        if final.exists():  # best: replaced; gone at once, never half deleted
            old = temp_path(final)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(temp, final)
        fsync_path(final.parent)
    return final



# ---------------------------------------------------------------------------------------------------- safe reading
class DamagedCheckpoint(ValueError):
    """A sharded checkpoint's own files are missing, truncated, hostile or inconsistent (never loaded)."""


#: What a DCP ``.metadata`` pickle may name: DCP's own metadata records, torch sizes, dtypes and layouts, paths.
#: Anything else (``os.system``, ``operator.getitem``, a planted class) stops the read: unpickling runs code.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex", "bytearray", "range"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a DCP .metadata file holds only DCP's "
                                     f"metadata records, so this one was written by something else")


def read_metadata(folder: Path) -> Any:
    """The checkpoint's DCP metadata, read with an unpickler that builds nothing but DCP's records (torch's own
    reader calls ``pickle.load``: a planted ``.metadata`` would run code)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / ".metadata"
    _regular_file(path)
    try:
        with open(path, "rb") as fh:
            meta = _MetadataUnpickler(fh).load()
    except Exception as exc:  # noqa: BLE001 -- damaged bytes raise anything pickle can (OverflowError on a huge FRAME)
        raise DamagedCheckpoint(f"{path} is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, Metadata) or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise DamagedCheckpoint(f"{path} does not hold DCP metadata (found a {type(meta).__name__})")
    return meta


def _regular_file(path: Path) -> os.stat_result:
    """Stat ``path``, refusing what is not a regular file (a FIFO would block every reader forever)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DamagedCheckpoint(f"{path} is missing ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise DamagedCheckpoint(f"{path} is not a regular file")
    return st


def verify(folder: Path) -> Any:
    """Check a committed sharded checkpoint without reading its tensors: the metadata is DCP's, every shard file
    it names exists inside the folder and is long enough, and the tensors it declares fit in those files.
    Returns the metadata; raises ``DamagedCheckpoint``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    _regular_file(folder / EXTRAS)
    meta = read_metadata(folder)
    ends: dict[str, int] = {}
    for item in (meta.storage_data or {}).values():
        name = str(getattr(item, "relative_path", ""))
        if not name or Path(name).name != name or name.startswith("."):
            raise DamagedCheckpoint(f"{folder}/.metadata names a shard file {name!r} outside the checkpoint")
        end = int(item.offset) + int(item.length)
        ends[name] = max(ends.get(name, 0), end)
    on_disk = 0
    for name, end in ends.items():
        size = _regular_file(folder / name).st_size
        if size < end:
            raise DamagedCheckpoint(f"shard {folder / name} is truncated ({size} bytes, its metadata needs {end})")
        on_disk += size
    declared = 0
    for entry in meta.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            numel = 1
            for dim in entry.size:
                numel *= int(dim)
            declared += numel * torch.empty((), dtype=entry.properties.dtype).element_size()
    if declared > 2 * on_disk + (1 << 20):  # tensors are stored raw; serialisation adds little
        raise DamagedCheckpoint(f"{folder}/.metadata declares {declared:,} bytes of tensors but its shards hold "
                                f"{on_disk:,}: the metadata does not belong to these files")
    return meta


def _reader(folder: Path) -> Any:
    """torch's file-system reader, with ``read_metadata`` in place of its ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            meta = read_metadata(Path(str(self.path)))
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(str(folder))


def _planner() -> Any:
    """DCP's default planner, loading non-tensor items with ``weights_only=True`` (torch's loads them unchecked)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its planner uses

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def read_extras(folder: Path) -> dict[str, Any]:
    _regular_file(Path(folder) / EXTRAS)
    return torch.load(folder / EXTRAS, map_location="cpu", weights_only=True)


def load_into(folder: Path, model: Any, optimizer: Any) -> None:
    """Load the model (and optimizer) shards into live objects, resharded to this run's layout (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    with _single_process():
        dcp.load(state, storage_reader=_reader(folder), planner=_planner(),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
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

    metadata = verify(folder)
    template: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata):
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if template:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with _single_process():
                dcp.load(template, storage_reader=_reader(folder), planner=_planner(), no_dist=True)
        except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException
            first = next((line for line in str(exc).splitlines()[::-1] if line.strip()), type(exc).__name__)
            raise DamagedCheckpoint(f"cannot read the shards of {folder}: {first.strip()[:300]}") from None
    return {key[len(prefix) + 1:]: value for key, value in template.items()}


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it 'assumes' one process even when told so (no_dist=True); that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch.distributed is disabled, unavailable or uninitialized")
        yield


def size_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def load_checked(folder: Path, parts: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Load a sharded checkpoint's model and optimizer into ``parts`` (resharded), or say in words why not."""
    model, optimizer = parts.get("model"), parts.get("optimizer")
    if optimizer is not None and state.get("optimizer_class") not in (None, type(optimizer).__name__):
        raise CheckpointError(f"{folder} holds the state of a {state['optimizer_class']} optimizer, but this run uses "
                              f"{type(optimizer).__name__}. HINT: resume with the same optimizer, or start a new run "
                              f"(another log_folder, or resume=None).")
    if model is None:
        return
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load_into(folder, model, optimizer)
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        lines = [line.strip() for line in _messages(exc) if line.strip()] or [type(exc).__name__]
        detail = next((line for line in lines if "size" in line.lower() or "missing" in line.lower()), None)
        if detail is None:  # not a shape or key difference: the shards themselves cannot be read
            raise UnreadableCheckpoint(f"checkpoint {folder} is unreadable: {lines[0][:300]}") from None
        raise CheckpointError(f"{folder} does not fit this run's model: {detail[:300]}. HINT: a checkpoint only "
                              f"loads into the same model and optimizer it was written from; start a new run "
                              f"(another log_folder, or resume=None) after changing them.") from None


def _messages(exc: BaseException) -> list[str]:
    """The lines of an error, and of every rank's failure inside DCP's CheckpointException."""
    lines = str(exc).splitlines()
    for failure in getattr(exc, "failures", {}).values():
        lines += str(failure).splitlines()
    return lines

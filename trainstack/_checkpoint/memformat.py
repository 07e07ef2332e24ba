"""The memory checkpoints' copy of a state and its file format: ``staged`` copies a rank's state into CPU memory
training can no longer change (a DTensor becomes its local shard; reused buffers, pinned from a GPU), ``unstaged``
lays the shards out again; ``packed``/``unpacked`` are one copy's bytes -- a small header (the state with each
tensor a placeholder, ``torch.save``d, read back with ``weights_only=True``) and the tensors' raw bytes, so writing,
hashing and sending them releases the GIL.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["staged", "unstaged", "laid_out", "packed", "unpacked", "is_dtensor"]

_LOCAL = "__trainstack_local_shard__"  # a DTensor's local shard, in a staged state


# ---------------------------------------------------------------------------------------------------- staging
def staged(obj: Any, buffers: dict[str, torch.Tensor] | None = None, key: str = "") -> Any:
    """A copy of ``obj`` (a state dict, nested) in CPU memory that training can no longer change; a DTensor becomes
    its local shard (rebuilt by ``unstaged`` on the same layout). ``buffers`` (by position in the state) are reused
    when they fit: copying into memory already mapped is several times faster than into fresh pages; from a GPU
    into pinned memory, one synchronization for the whole state."""
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            return {_LOCAL: staged(obj.to_local(), buffers, key)}  # type: ignore[attr-defined]
        if buffers is None:
            return obj.detach().to("cpu", copy=True)
        buf = buffers.get(key)
        if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
            buf = buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.device.type == "cuda")
        return buf.copy_(obj.detach(), non_blocking=obj.device.type == "cuda")
    if isinstance(obj, dict):
        return {k: staged(v, buffers, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [staged(v, buffers, f"{key}/{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def unstaged(obj: Any, like: Any) -> Any:
    """``obj`` with every local shard made a DTensor again, laid out as the matching DTensor of ``like`` (the live
    state of the same structure: a model's state dict, an optimizer's with its parameters)."""
    if isinstance(obj, dict) and set(obj) == {_LOCAL}:
        if not is_dtensor(like):
            raise ValueError("a sharded tensor of the memory checkpoint has no sharded counterpart in this run")
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(obj[_LOCAL].to(like.device), like.device_mesh, like.placements, run_check=False,
                                  shape=like.size(), stride=like.stride())
    if isinstance(obj, dict):
        return {k: unstaged(v, like.get(k) if isinstance(like, dict) else None) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [unstaged(v, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None)
                 for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def laid_out(state: Mapping[str, Any], parts: Mapping[str, Any]) -> dict[str, Any]:
    """A staged checkpoint state (``model``, ``optimizer``, the rest) with every local shard a DTensor again, laid
    out as ``parts``' model and optimizer (this run's: the same shard layout, perhaps another mesh)."""
    from .parts import state_of

    state = dict(state)
    model, optimizer = parts.get("model"), parts.get("optimizer")
    if model is not None and state.get("model") is not None:
        state["model"] = unstaged(state["model"], state_of(model))
    if optimizer is not None and state.get("optimizer") is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        like = {"state": {i: {k: params[int(i)] for k in entry}
                          for i, entry in state["optimizer"]["state"].items() if int(i) < len(params)}}
        state["optimizer"] = unstaged(state["optimizer"], like)
    return state


def is_dtensor(t: Any) -> bool:
    """A DTensor (sharded), told by its type name: torch.distributed.tensor is not imported for it."""
    return type(t).__name__ == "DTensor"


# ---------------------------------------------------------------------------------------------------- the format
_MAGIC = b"TSMEM001"
_TENSOR = "__trainstack_tensor__"
_ALIGN = 64


def packed(state: Any) -> list[memoryview]:
    """A staged state as the chunks of one file: magic, header length, the header (the state with every tensor a
    numbered placeholder, and the tensors' dtypes, shapes and offsets, ``torch.save``d), then each tensor's raw
    bytes. Writing, hashing and sending raw bytes releases the GIL: only the small header is pickled, so training
    keeps its thread while a copy is written."""
    tensors: list[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        tensors.append(obj.contiguous())
        return {_TENSOR: len(tensors) - 1}

    skeleton = _walk(state, strip)
    raw = [t.reshape(-1).view(torch.uint8).numpy().data for t in tensors]
    table, offset = [], 0
    for t, chunk in zip(tensors, raw, strict=True):
        table.append((str(t.dtype).removeprefix("torch."), list(t.shape), offset, chunk.nbytes))
        offset += _padded(chunk.nbytes)
    header = io.BytesIO()
    torch.save({"skeleton": skeleton, "table": table}, header)
    head = header.getvalue()
    start = _padded(len(_MAGIC) + 8 + len(head))
    first = _MAGIC + len(head).to_bytes(8, "little") + head
    chunks = [memoryview(first + b"\0" * (start - len(first)))]
    for chunk in raw:
        chunks += [chunk, memoryview(b"\0" * (_padded(chunk.nbytes) - chunk.nbytes))]
    return chunks


def unpacked(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The state ``packed`` wrote (tensors copied out of ``data``); ``ValueError`` for anything else."""
    view = memoryview(data)
    if bytes(view[:8]) != _MAGIC:
        raise ValueError("not a trainstack memory checkpoint")
    size = int.from_bytes(view[8:16], "little")
    header = torch.load(io.BytesIO(view[16:16 + size]), map_location="cpu", weights_only=True)
    start = _padded(16 + size)
    buffer = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
    tensors = [buffer[start + off:start + off + n].view(getattr(torch, dtype)).reshape(shape).clone()
               for dtype, shape, off, n in header["table"]]

    return _walk(header["skeleton"], lambda obj: tensors[obj[_TENSOR]] if isinstance(obj, dict)
                 and set(obj) == {_TENSOR} else None)


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` (nested dicts, lists, tuples) with ``leaf(x)`` in place of every part it returns a value for."""
    found = leaf(obj)
    if found is not None:
        return found
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_walk(v, leaf) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN

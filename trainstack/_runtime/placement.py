"""Batches onto the GPU without a stall: each host-to-GPU copy goes on a copy stream of its own, so it runs while
the GPU is still busy with the step before (the host is ahead of the GPU: the previous step's kernels are queued,
not finished, when the loop asks for the next batch), and the compute stream waits for the copy only when the step
needs it -- no look-ahead on the loader (its position, RNG and heartbeats stay exactly where the loop is), no host
synchronisation. A batch's memory is marked in use by the compute stream (``record_stream``), so the caching
allocator never hands it out while the step still reads it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["on_copy_stream"]

_STREAMS: dict[int, torch.cuda.Stream] = {}  # one copy stream per device, per process (streams do not pickle)


def on_copy_stream(batch: Any, device: torch.device, move: Callable[[Any], Any]) -> Any:
    """``move(batch)`` with its copies on ``device``'s copy stream; the current stream waits for them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    compute = torch.cuda.current_stream(index)
    with torch.cuda.stream(stream):  # its blocks belong to the copy stream; record_stream below guards their reuse
        moved = move(batch)
    compute.wait_stream(stream)
    _mark_used(moved, compute)
    return moved


def _mark_used(obj: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, dict):
        for value in obj.values():
            _mark_used(value, stream)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _mark_used(value, stream)

"""Collectives that are identities on one process, so user code needs no ``if world_size > 1``."""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError

__all__ = ["all_reduce_dict", "gather", "gather_objects", "broadcast", "active", "steady_buckets"]

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active() -> bool:
    """True when a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"all_reduce_dict: value {name!r} has shape {tuple(value.shape)}; only scalars "
                              f"(0-d tensors or numbers) can be reduced together. HINT: reduce it with gather().")
        return value.detach().reshape(())
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value))
    raise ConfigError(f"all_reduce_dict: value {name!r} is a {type(value).__name__}; expected a tensor or number.")


def all_reduce_dict(d: dict[str, Any], op: str = "mean", comm_device: torch.device | None = None,
                    out_device: torch.device | None = None) -> dict[str, Any]:
    """Reduce all values of ``d`` with one collective. Tensors come back as tensors on ``out_device``,
    numbers as floats. ``op`` is ``mean``, ``sum``, ``max`` or ``min``."""
    if op not in _OPS:
        raise ConfigError(f"all_reduce_dict: op={op!r} must be one of {sorted(_OPS)}.")
    if not d or not active():
        return dict(d)
    keys = list(d)
    flat = torch.stack([_as_tensor(k, d[k]).to(dtype=torch.float64, device=comm_device or "cpu") for k in keys])
    dist.all_reduce(flat, op=_OPS[op])
    if op == "mean":
        flat /= dist.get_world_size()
    out: dict[str, Any] = {}
    for i, k in enumerate(keys):
        v = d[k]
        if isinstance(v, torch.Tensor):
            out[k] = flat[i].to(dtype=v.dtype if v.is_floating_point() else torch.float64,
                                device=out_device or v.device)
        else:
            out[k] = float(flat[i])
    return out


def gather(tensor: torch.Tensor, comm_device: torch.device) -> torch.Tensor:
    """Concatenate a tensor from every rank along dim 0; the sizes of dim 0 may differ between ranks."""
    if not active():
        return tensor
    world = dist.get_world_size()
    local = tensor.detach().to(comm_device)
    if local.dim() == 0:
        local = local.reshape(1)
    sizes = [torch.zeros(1, dtype=torch.long, device=comm_device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local.shape[0]], device=comm_device))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=comm_device)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
    return out.to(tensor.device)


def broadcast(obj: Any, src: int, comm_device: torch.device) -> Any:
    """Send a tensor (in place, same shape everywhere) or any picklable object from ``src``."""
    if not active():
        return obj
    if isinstance(obj, torch.Tensor):
        buf = obj.detach().to(comm_device).clone()
        dist.broadcast(buf, src=src)
        return buf.to(obj.device)
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj`` on rank ``dst`` (a list by rank; None elsewhere)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def steady_buckets(ddp: DistributedDataParallel, world_size: int) -> bool:
    """Fix DDP's gradient bucket layout before the first step, so a restarted process reduces gradients exactly as
    the process it replaces did (an exact resume). DDP rebuilds its buckets after a process's first backward;
    with three or more ranks the summation order of each element depends on its place in the bucket, so the first
    step after a restart would round differently in the last bit. Done where all gradients share one bucket (no
    overlap of communication with the backward is lost); True when the layout was fixed."""
    if world_size < 3:  # two addends sum the same in either order
        return False
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if sum(p.numel() * p.element_size() for p in params) > getattr(ddp, "bucket_bytes_cap", 0):
        return False  # several buckets: their order overlaps the backward; DDP's own rebuild keeps it
    try:  # every rank: the rebuild agrees the layout with rank 0
        ddp.reducer._push_all_rebuilt_params()
        return bool(ddp.reducer._rebuild_buckets())
    except (AttributeError, RuntimeError):  # a torch without these internals: DDP's own behaviour
        return False

"""Accelerate's collective operations on nested data (tensors inside lists, tuples, dicts), over the default
process group: ``gather``, ``gather_object``, ``broadcast``, ``broadcast_object_list``, ``reduce``,
``pad_across_processes``, ``send_to_device``, ``synchronize_rng_states``; and ``find_executable_batch_size``.
With one process every operation returns its input. Under ``state.debug`` the shapes are compared across
processes first, and a mismatch is a ``DistributedOperationException`` naming them instead of a hang."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .state import PartialState

__all__ = ["DistributedOperationException", "gather", "gather_object", "broadcast", "broadcast_object_list",
           "reduce", "pad_across_processes", "send_to_device", "synchronize_rng_states", "recursively_apply",
           "find_executable_batch_size", "copy_tensor_to_devices", "apply_to_tensors",
           "wait_for_everyone"]


class DistributedOperationException(Exception):
    """Processes called a collective with tensors of different shapes (``state.debug``)."""


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def recursively_apply(func: Callable[[torch.Tensor], Any], data: Any, *args: Any, **kwargs: Any) -> Any:
    """``func`` on every tensor of a nested structure, the structure (list, tuple, namedtuple, dict) kept."""
    if isinstance(data, (tuple, list)):
        items = [recursively_apply(func, d, *args, **kwargs) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, *args, **kwargs) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, torch.Tensor):
        return func(data, *args, **kwargs)
    return data


def apply_to_tensors(name: str, func: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``func`` on every tensor of a nested structure; anything else is an error naming ``name``'s alternative."""
    def one(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return func(item)
        if isinstance(item, (tuple, list)):
            items = [one(d) for d in item]
            return type(item)(*items) if hasattr(item, "_fields") else type(item)(items)
        if isinstance(item, Mapping):
            return type(item)({k: one(v) for k, v in item.items()})  # type: ignore[call-arg]
        from ..errors import ConfigError

        raise ConfigError(f"{name}() takes tensors (or lists, tuples, dicts of them), not a {type(item).__name__}. "
                          f"HINT: gather_object() gathers any picklable object.")
    return one(data)


def _shapes(data: Any) -> list[Any]:
    out: list[Any] = []
    recursively_apply(lambda t: out.append(list(t.shape)), data)
    return out


def _checked(name: str, data: Any) -> None:
    """Under ``PartialState().debug``: every process passes tensors of the same shapes, else a clear error."""
    if not (PartialState._shared_state.get("debug") and _active()):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _shapes(data))
    if any(s != everyone[0] for s in everyone):
        raise DistributedOperationException(
            f"Cannot apply the desired operation ({name}) due to shape mismatches. All shapes across devices must be "
            f"valid.\n\nOperation: `{name}`\nInput shapes:\n" + "\n".join(
                f"  - Process {i}: {s}" for i, s in enumerate(everyone)))


def _device_for(tensor: torch.Tensor) -> torch.Tensor:
    """gloo moves CPU tensors; NCCL needs them on this process's GPU."""
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


def gather(tensor: Any) -> Any:
    """Every process's tensors concatenated along dim 0, in process order (a 0-d tensor counts as one row); nested
    structures are gathered leaf by leaf."""
    if not _active():
        return tensor
    _checked("gather", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        t = _device_for(t.contiguous() if t.dim() else t.reshape(1))
        out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return torch.cat(out, dim=0)
    return recursively_apply(one, tensor)


def gather_object(obj: Any) -> list[Any]:
    """Every process's picklable ``obj`` in one list, in process order (lists are concatenated)."""
    if not _active():
        return obj if isinstance(obj, list) else [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return [x for part in everyone for x in part] if all(isinstance(p, list) for p in everyone) else everyone


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Process ``from_process``'s tensors on every process (a nested structure leaf by leaf)."""
    if not _active():
        return tensor
    _checked("broadcast", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        out = _device_for(t.contiguous().clone())
        dist.broadcast(out, src=from_process)
        return out.to(t.device)
    return recursively_apply(one, tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """``object_list`` filled in place with process ``from_process``'s objects; returned too."""
    if _active():
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Every process's tensors reduced element-wise -- ``sum``, ``mean``, ``max``, ``min`` (``none``: unchanged) --
    on every process; a copy, the input is untouched."""
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if reduction not in (*ops, "none"):
        from ..errors import ConfigError

        raise ConfigError(f"reduce(reduction={reduction!r}): must be one of 'sum', 'mean', 'max', 'min', 'none'.")
    if _active():
        _checked("reduce", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if reduction == "none" or not _active():
            return out * scale if scale != 1.0 else out
        moved = _device_for(out)
        dist.all_reduce(moved, op=ops[reduction])
        moved = moved.to(out.device)
        if reduction == "mean":
            moved = moved / dist.get_world_size()
        return moved * scale if scale != 1.0 else moved
    return recursively_apply(one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Tensors padded along ``dim`` to the longest on any process (so they can be gathered), with ``pad_index``,
    at the end (or the start with ``pad_first``)."""
    if not _active():
        return tensor
    _checked("pad_across_processes", tensor)

    def one(t: torch.Tensor) -> torch.Tensor:
        if dim >= t.dim() or dim < -t.dim():
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        longest = int(gather(size).max())
        if t.shape[dim] == longest:
            return t
        shape = list(t.shape)
        shape[dim] = longest
        out = t.new_full(shape, pad_index)
        index = [slice(None)] * t.dim()
        index[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[tuple(index)] = t
        return out
    return recursively_apply(one, tensor)


def wait_for_everyone() -> None:
    """Every process waits here for the others (a barrier; nothing on one process)."""
    if _active():
        dist.barrier()


def send_to_device(data: Any, device: Any, non_blocking: bool = False, skip_keys: Any = None) -> Any:
    """Every tensor of a nested structure on ``device`` (keys in ``skip_keys`` of a mapping left as they are)."""
    skip = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys or ())
    if isinstance(data, Mapping):
        moved = {k: v if k in skip else send_to_device(v, device, non_blocking) for k, v in data.items()}
        return type(data)(moved)  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        items = [send_to_device(d, device, non_blocking) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if hasattr(data, "to") and isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    return data


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Process 0's tensor on every process (the others pass None)."""
    holder: list[Any] = [tensor]
    broadcast_object_list(holder)
    return holder[0]


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Process 0's random state copied to every process for each of ``rng_types`` (``torch``, ``cuda``,
    ``generator``: the given one)."""
    if not _active():
        return
    for kind in rng_types:
        if kind == "torch":
            state = torch.get_rng_state()
        elif kind == "cuda":
            state = torch.cuda.get_rng_state()
        elif kind == "generator":
            if generator is None:
                continue
            state = generator.get_state()
        else:
            continue
        holder = [state]
        dist.broadcast_object_list(holder, src=0)
        if kind == "torch":
            torch.set_rng_state(holder[0])
        elif kind == "cuda":
            torch.cuda.set_rng_state(holder[0])
        elif generator is not None:
            generator.set_state(holder[0])


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Any:
    """Call ``function(batch_size, ...)`` with ``starting_batch_size``, halved after each out-of-memory error, until
    it runs (Accelerate's decorator); a batch size of 0 is an error."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        gc.collect()
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove this as the decorator already does so: `{function.__name__}()`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not _out_of_memory(exc):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce_batch_size_fn() if reduce_batch_size_fn else batch_size // 2
    return decorator


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    markers = ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
               "DefaultCPUAllocator: can't allocate memory")
    return isinstance(exc, RuntimeError) and any(s in text for s in markers)

"""A model made ready for its world: to the device and dtype, laid out (tensor parallelism, activation
checkpointing), compiled in place when asked, then wrapped for data parallelism -- DDP, or FSDP/HSDP's
``fully_shard`` in place over the mesh -- when the world has more than one process. What ``Accelerator.prepare_model``
runs; the settings it reads are the Accelerator's (``Wrapping``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import collectives, compiling
from .parallel import Layout, Parallelism, lay_out

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Wrapping", "wrap_model"]

log = logging.getLogger(__name__)


class Wrapping(Protocol):
    """What of the Accelerator a model's preparation reads."""

    @property
    def device(self) -> torch.device: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main_process(self) -> bool: ...

    dtype: torch.dtype | None
    parallelism: Parallelism
    strategy: str
    compile_options: dict[str, Any] | None
    fsdp_blocks: tuple[str, ...] | None
    fsdp_min_params: int
    fsdp_param_dtype: torch.dtype | None
    use_cuda: bool
    handlers: Any


def wrap_model(model: nn.Module, acc: Wrapping, moved: dict[int, nn.Parameter] | None = None
               ) -> tuple[nn.Module, DeviceMesh | None, bool]:
    """(the model to train, the mesh it was laid out on, whether it was laid out now -- False: already prepared);
    ``moved`` collects old parameter id -> new parameter (optimizers follow)."""
    from .fsdp import ONE_PROCESS_NOTE, is_sharded, shard

    model, options = compiling.plan(model, acc.compile_options)
    if isinstance(model, DistributedDataParallel) or is_sharded(model):
        return model, None, False
    before = {name: id(p) for name, p in model.named_parameters()}
    model = model.to(device=acc.device, dtype=acc.dtype) if acc.dtype else model.to(acc.device)
    layout = acc.layout
    model, mesh = lay_out(model, layout, acc.parallelism, acc.strategy, acc.device.type, acc.is_main_process,
                          (acc.fsdp_blocks, acc.fsdp_min_params), compiled=acc.compile_options is not None)
    wrapped = model
    if acc.world_size > 1 and dist.is_initialized():
        if not any(p.requires_grad for p in model.parameters()):
            log.warning("Model has no trainable parameters; not wrapping it for data parallelism.")
        elif acc.strategy in ("fsdp", "hsdp"):
            assert mesh is not None
            wrapped = shard(model, layout.fsdp_mesh(mesh), acc.fsdp_blocks, acc.fsdp_min_params,
                            acc.fsdp_param_dtype, compile_options=options)
            options = None  # compiled block by block before sharding
        else:
            wrapped = DistributedDataParallel(model, device_ids=[acc.device.index] if acc.use_cuda else None,
                                              **acc.handlers.ddp.to_kwargs())
            acc.handlers.ddp.register_comm_hook(wrapped)
            collectives.steady_buckets(wrapped, acc.world_size)
    elif acc.strategy != "ddp" and acc.is_main_process:
        print(ONE_PROCESS_NOTE, flush=True)
    compiling.compile_in_place(model, options)  # in place: DDP's module is this one, keys stay plain
    if moved is not None:
        for name, p in model.named_parameters():
            if id(p) != before.get(name):
                moved[before[name]] = p
    return wrapped, mesh, True

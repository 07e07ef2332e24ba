"""The part of HF Accelerate's ``Accelerator`` vocabulary that is about Accelerate's own objects -- its state,
gradient state, data-loader settings, triggers, joins, nested collectives, saving a model -- as a base class of
trainstack's ``Accelerator``, which provides the processes, devices and preparing (docs/migration/accelerate.md)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._runtime import loop as _loop
from .._runtime.watchdog import heartbeat
from ..errors import ConfigError, LaunchError
from . import ops
from .config import DataLoaderConfiguration, ProjectConfiguration
from .loader import BatchSamplerShard, DataLoaderShard, prepare_data_loader
from .loop import AccelerateLoop
from .state import AcceleratorState, DistributedType, GradientState

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from .._runtime.layout import WorkerContext
    from .._runtime.parallel import Layout
    from .config import ProfileKwargs
    from .options import Handlers

__all__ = ["AccelerateAPI"]


class AccelerateAPI(AccelerateLoop):
    """Accelerate's names for what the state and the prepared objects know. The Accelerator sets, in its
    constructor: ``dataloader_config``, ``project_configuration``, ``rng_types``, ``handlers``,
    ``step_scheduler_with_optimizer``; and owns ``device``, ``mixed_precision``, ``use_cuda``, ``backend`` and
    ``strategy``."""

    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    rng_types: list[str]
    handlers: Handlers
    step_scheduler_with_optimizer: bool
    mixed_precision: str
    use_cuda: bool
    backend: str
    strategy: str
    device_placement: bool
    data_dtype: torch.dtype | None
    _state: AcceleratorState | None
    _prepared: dict[str, list[Any]]
    _trigger: bool

    if TYPE_CHECKING:  # the Accelerator's
        @property
        def device(self) -> torch.device: ...

        def gather(self, tensor: Any) -> Any: ...

        def prepare_batch(self, batch: Any) -> Any: ...

        def _ctx(self) -> WorkerContext: ...

        @property
        def pin_memory(self) -> bool: ...

        @property
        def layout(self) -> Layout: ...

        def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                         keep_torch_compile: bool = True) -> nn.Module: ...

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> AcceleratorState:
        """The process's ``AcceleratorState`` (made when first asked, also after unpickling, and again where the
        shared state describes another process since: a forked parent's, another Accelerator's plan)."""
        if self._state is None or self._state.__dict__.get("ctx") not in (None, self._ctx()):
            self._state = AcceleratorState(self.mixed_precision, cpu=not self.use_cuda, backend=self.backend,
                                           strategy=self.strategy, _context=self._ctx())
        return self._state

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def gradient_state(self) -> GradientState:
        return GradientState()

    num_processes = property(lambda self: self.world_size, doc="Accelerate's name of ``world_size``.")
    process_index = property(lambda self: self.rank, doc="Accelerate's name of ``rank``.")
    local_process_index = property(lambda self: self.local_rank, doc="Accelerate's name of ``local_rank``.")

    def wait_for_everyone(self) -> None:
        """Every process waits here for the others (a barrier; nothing on one process)."""
        self.barrier()

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """All-reduce tensors over the ranks (``sum``, ``mean``, ``max``, ``min``; nested structures leaf by leaf),
        times ``scale``; a copy, the input is untouched."""
        return ops.reduce(tensor, reduction, scale)

    def _check_state(self) -> None:
        """The shared process state still describes this process (a reset state is Accelerate's error, here)."""
        state = self.state
        if state.num_processes != self.world_size or state.process_index != self.rank:
            raise LaunchError(f"the process state says process {state.process_index} of {state.num_processes}, "
                              f"this Accelerator {self.rank} of {self.world_size}: it was made in another process. "
                              f"HINT: make the Accelerator inside the function that runs on every process.")

    split_batches = property(lambda self: self.dataloader_config.split_batches)
    even_batches = property(lambda self: self.dataloader_config.even_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    logging_dir = property(lambda self: self.project_configuration.logging_dir)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step did not run (fp16 found inf/NaN gradients)."""
        return any(getattr(o, "step_was_skipped", False) for o in self._prepared["optimizer"])

    # ------------------------------------------------------------------ which process runs what
    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self.state.on_last_process(function)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        return self.state.on_process(function, process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
                         ) -> Any:
        return self.state.on_local_process(function, local_process_index)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False
                                ) -> contextlib.AbstractContextManager[Any]:
        """``with accelerator.split_between_processes(items) as mine:`` -- this process's share of ``items``."""
        return self.state.split_between_processes(inputs, apply_padding)

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.state.local_main_process_first()

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward passes in the block do not all-reduce gradients (DDP's ``no_sync``; nothing on one process)."""
        no_sync = getattr(model, "no_sync", None) if self.use_distributed else None
        with no_sync() if no_sync is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """The next backward in the block all-reduces gradients even inside ``no_sync`` (after several forwards
        under ``no_sync``, the last backward syncs everything accumulated)."""
        if not (self.use_distributed and hasattr(model, "reducer")):
            yield
            return
        ddp: Any = model
        old = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = old

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Processes may run out of batches at different times inside the block (``even_batches=False``): DDP's
        ``Join`` shadows the collectives of those that finished. ``even_batches`` overrides the loaders' setting
        for the block (map-style loaders only)."""
        if self.distributed_type not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
            if self.distributed_type != DistributedType.NO:
                warnings.warn("Joining uneven inputs is only supported for multi-GPU (and multi-CPU) DDP training; "
                              f"{self.distributed_type.value} runs without it.", UserWarning, stacklevel=3)
            yield
            return
        from torch.distributed.algorithms.join import Join

        saved: list[tuple[BatchSamplerShard, bool]] = []
        if even_batches is not None:
            shards = [getattr(dl, "shard_sampler", None) for dl in self._prepared["loader"]]
            if any(not isinstance(s, BatchSamplerShard) for s in shards):
                warnings.warn("Overriding even_batches is only supported for map-style datasets; some prepared "
                              "loaders iterate a dataset without a sampler.", UserWarning, stacklevel=3)
            for shard in shards:
                if isinstance(shard, BatchSamplerShard):
                    saved.append((shard, shard.even_batches))
                    shard.even_batches = even_batches
        else:
            even_batches = self.even_batches
        try:
            with Join(list(joinables), enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for shard, value in saved:
                shard.even_batches = value

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """``with accelerator.profile() as prof:`` -- torch's profiler over the block, with the Accelerator's
        ``ProfileKwargs``; with ``output_trace_dir`` each process writes ``trace_<rank>.json`` there."""
        settings = profile_handler or self.handlers.profile
        with settings.build() as prof:
            yield prof
        if settings.output_trace_dir:
            folder = Path(settings.output_trace_dir)
            folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(folder / f"trace_{self.state.process_index}.json"))
        self.state.wait_for_everyone()

    # ------------------------------------------------------------------ triggers
    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process (e.g. stop early)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called ``set_trigger`` since the last check (collective)."""
        flag = torch.tensor(1.0 if self._trigger else 0.0)
        if self.use_distributed and dist.is_initialized():
            flag = ops.reduce(flag, "sum")
        if flag.item() >= 1:
            self._trigger = False
            return True
        return False

    # ------------------------------------------------------------------ data
    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> DataLoaderShard:
        """This process's share of ``data_loader``, in the loader's own order (see ``trainstack.data_loader``)."""
        config = self.dataloader_config
        placement = self.device_placement if device_placement is None else device_placement
        layout = self.layout  # the ranks of a tensor-parallel group read the same batches
        prepared = prepare_data_loader(
            data_loader, None, layout.data_world, layout.data_rank(self.state.process_index),
            split_batches=config.split_batches, put_on_device=False, rng_types=list(self.rng_types),
            dispatch_batches=config.dispatch_batches, even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler, data_seed=config.data_seed,
            non_blocking=config.non_blocking, use_stateful_dataloader=config.use_stateful_dataloader,
            pin_memory=self.pin_memory)
        if placement and (self.device.type != "cpu" or self.data_dtype is not None):
            prepared.place = self.prepare_batch  # to the device, floating tensors in the model's dtype
        prepared.heartbeat = heartbeat()  # each batch is progress for the hang watchdog
        self._prepared["loader"].append(prepared)
        return prepared

    # ------------------------------------------------------------------ nested collectives
    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every process's ``input_data`` (tensors gathered, other objects with ``gather_object``), without the
        samples the last batch repeated to even the shards out: each sample counted once."""
        state = self.gradient_state
        if not isinstance(state.active_dataloader, DataLoaderShard):  # trainstack's own loaders: per-rank padding
            return self._gather_unpadded(input_data)
        tensors_only = _only_tensors(input_data)
        if use_gather_object or not tensors_only:
            data = ops.gather_object(input_data)
        else:
            data = self.gather(input_data)
        if state.end_of_dataloader and state.remainder > 0:
            keep = state.remainder
            return data[:keep] if use_gather_object or not tensors_only else ops.recursively_apply(
                lambda t: t[:keep], data)
        return data

    def _gather_unpadded(self, data: Any) -> Any:
        """Gather from every rank without the duplicates a padded shard ends with (``LoopState.padding``)."""
        pad = _loop.STATE.padding

        def one(item: Any) -> Any:
            if isinstance(item, torch.Tensor):
                item = item[: len(item) - pad] if pad and item.dim() > 0 else item
                return self.gather(item if item.dim() > 0 else item.reshape(1)) if self.use_distributed else item
            if isinstance(item, list):
                mine = list(item[: len(item) - pad] if pad else item)
                return ops.gather_object(mine) if self.use_distributed else mine
            if isinstance(item, dict):
                return type(item)({k: one(v) for k, v in item.items()})
            if isinstance(item, tuple):
                return type(item)(one(v) for v in item)
            return item

        return one(data)

    # ------------------------------------------------------------------ saving a model
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU (the user's module inside DDP/compile when ``unwrap``)."""
        module = self.unwrap_model(model) if unwrap else model
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> Path | None:
        """The unwrapped model's weights in ``save_directory`` (``model.safetensors``, or ``pytorch_model.bin``),
        written by the main process, atomically."""
        folder = Path(save_directory)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"save_model({str(folder)!r}): that is a file; save_model takes a folder.")
        weights = self.get_state_dict(model)
        path = folder / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
        if self.state.is_main_process:
            from .._common.files import atomic_write

            folder.mkdir(parents=True, exist_ok=True)
            if safe_serialization:
                from safetensors.torch import save as to_bytes

                atomic_write(path, to_bytes({k: v.contiguous() for k, v in weights.items()}))
            else:
                import io

                buffer = io.BytesIO()
                torch.save(weights, buffer)
                atomic_write(path, buffer.getvalue())
        self.state.wait_for_everyone()
        return path if self.state.is_main_process else None

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors) on the main process only, written atomically."""
        if not self.state.is_main_process:
            return
        from .._common.files import atomic_write

        if safe_serialization:
            from safetensors.torch import save as to_bytes

            atomic_write(Path(f), to_bytes(obj))
            return
        import io

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        atomic_write(Path(f), buffer.getvalue())

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        """Forget the prepared objects (and empty the CUDA cache); returns ``None`` for each object given."""
        import gc

        for kind in self._prepared:
            self._prepared[kind].clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)

    clear = free_memory


def _only_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(_only_tensors(d) for d in data)
    if isinstance(data, dict):
        return all(_only_tensors(d) for d in data.values())
    return False

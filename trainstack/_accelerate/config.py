"""Accelerate's configuration objects, with the settings trainstack runs; a setting it does not is refused in
``__post_init__`` naming it and what to do instead (never silently ignored)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import os
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError

__all__ = ["DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration",
           "DistributedDataParallelKwargs", "InitProcessGroupKwargs", "GradScalerKwargs", "KwargsHandler",
           "DDPCommunicationHookType", "ProfileKwargs", "AutocastKwargs"]


class KwargsHandler:
    """Settings handed to a torch object as keywords: ``to_kwargs`` gives the ones that differ from the default."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


@dataclasses.dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards DataLoaders (Accelerate's names). ``split_batches``: each batch is split over the
    processes instead of each process taking whole batches; ``even_batches``: the last batches are completed from
    the start so every process gets as many; ``use_seedable_sampler``/``data_seed``: shuffles are a function of
    (seed, epoch); ``non_blocking``: asynchronous host-to-GPU copies; ``use_stateful_dataloader``: loaders have
    ``state_dict``/``load_state_dict`` (trainstack's always do). ``dispatch_batches`` is not supported."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ConfigError("DataLoaderConfiguration(dispatch_batches=True) is not supported by trainstack (process "
                              "0 reading every batch and sending the others their share). HINT: leave it unset: "
                              "every process reads its own shard of the same order, with the same batches.")
        for name in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking",
                     "use_stateful_dataloader"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"DataLoaderConfiguration({name}={getattr(self, name)!r}): must be True or False.")
        if self.data_seed is not None and (isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int)):
            raise ConfigError(f"DataLoaderConfiguration(data_seed={self.data_seed!r}): must be an integer or None.")


@dataclasses.dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation (Accelerate's plugin): ``num_steps`` batches per optimizer step;
    ``sync_with_dataloader``: a loader's last batch always ends a window; ``sync_each_batch``: gradients are
    all-reduced on every batch (less memory, more communication); ``adjust_scheduler``: a prepared scheduler steps
    once per window (not per batch)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is not None and (isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int)
                                           or self.num_steps < 1):
            raise ConfigError(f"GradientAccumulationPlugin(num_steps={self.num_steps!r}): must be an integer >= 1.")


@dataclasses.dataclass
class ProjectConfiguration:
    """Where a project's files go: ``project_dir`` (checkpoints), ``logging_dir`` (trackers; default the project
    folder); ``automatic_checkpoint_naming``: ``save_state()`` without a folder writes
    ``project_dir/checkpoints/checkpoint_<n>``, keeping the newest ``total_limit``."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and (isinstance(self.total_limit, bool)
                                             or not isinstance(self.total_limit, int) or self.total_limit < 1):
            raise ConfigError(f"ProjectConfiguration(total_limit={self.total_limit!r}): must be an integer >= 1 or "
                              f"None (keep all).")
        if self.automatic_checkpoint_naming and self.project_dir is None:
            raise ConfigError("ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir: the "
                              "checkpoints go to project_dir/checkpoints/checkpoint_<n>.")

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        self.project_dir = None if project_dir is None else str(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


class DDPCommunicationHookType(str, enum.Enum):
    """How DDP compresses gradients before the all-reduce (torch's ``ddp_comm_hooks``)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclasses.dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Keywords for ``DistributedDataParallel`` (``find_unused_parameters`` is the one most scripts need), and a
    gradient communication hook: ``comm_hook`` (fp16/bf16 compression, PowerSGD), ``comm_wrapper`` (compress the
    hook's result), ``comm_state_option`` (PowerSGD's settings)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = DDPCommunicationHookType(self.comm_hook)
        self.comm_wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if self.comm_wrapper not in (DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16,
                                     DDPCommunicationHookType.BF16):
            raise ConfigError(f"DistributedDataParallelKwargs(comm_wrapper={self.comm_wrapper.value!r}): must be "
                              f"'no', 'fp16' or 'bf16'.")

    def to_kwargs(self) -> dict[str, Any]:
        """The ``DistributedDataParallel`` keywords (the hook settings are applied after wrapping)."""
        hook_fields = ("comm_hook", "comm_wrapper", "comm_state_option")
        return {k: v for k, v in super().to_kwargs().items() if k not in hook_fields}

    def register_comm_hook(self, model: Any) -> None:
        """Install the communication hook on a DDP-wrapped model (nothing for ``comm_hook='no'``)."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[DDPCommunicationHookType, Callable[..., Any]] = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook}
        wrappers = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
                    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper}
        hook = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        state = None
        if self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclasses.dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Process-group settings: ``timeout`` of collectives (a ``timedelta``); ``backend``."""

    backend: str | None = None
    init_method: str | None = None
    timeout: datetime.timedelta | None = None


@dataclasses.dataclass
class GradScalerKwargs(KwargsHandler):
    """Keywords for fp16's ``torch.amp.GradScaler``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class AutocastKwargs(KwargsHandler):
    """``torch.autocast`` settings for ``accelerator.autocast``."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclasses.dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` settings for ``accelerator.profile()``: ``activities`` (``"cpu"``, ``"cuda"``;
    default: what this machine has), ``schedule_option`` (``wait``/``warmup``/``active``/``repeat``/
    ``skip_first``), ``output_trace_dir`` (a Chrome trace per process, ``trace_<rank>.json``)."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable[..., Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def __post_init__(self) -> None:
        bad = [a for a in self.activities or () if a not in ("cpu", "cuda")]
        if bad:
            raise ConfigError(f"ProfileKwargs(activities={self.activities!r}): {bad[0]!r} is not one of 'cpu', "
                              f"'cuda'.")

    def build(self) -> Any:
        """The ``torch.profiler.profile`` these settings describe."""
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        names = self.activities or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        kinds = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
        return profile(activities=[kinds[n] for n in names],
                       schedule=schedule(**self.schedule_option) if self.schedule_option else None,
                       on_trace_ready=self.on_trace_ready, record_shapes=self.record_shapes,
                       profile_memory=self.profile_memory, with_stack=self.with_stack, with_flops=self.with_flops,
                       with_modules=self.with_modules)

"""Accelerate's process state objects over trainstack's runtime: ``PartialState`` (who this process is, joined to
its group as soon as it exists), ``AcceleratorState`` (plus the training settings), ``GradientState`` (where the
current loop stands), ``DistributedType``. Each shares one state per process, as Accelerate's do; a reset state is
an error naming what happened, never silently re-created."""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._runtime import layout as _layout
from .._runtime import loop as _loop
from ..environment import detect_environment

__all__ = ["DistributedType", "PartialState", "AcceleratorState", "GradientState", "join_process_group",
           "describes_a_plan"]


class DistributedType(str, enum.Enum):
    """What runs the processes (Accelerate's names; trainstack runs NO, MULTI_CPU, MULTI_GPU and FSDP)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def join_process_group(backend: str | None = None, use_cuda: bool | None = None) -> _layout.WorkerContext:
    """This process's identity, joined to its process group when the launcher started several (torchrun, srun):
    at once, as Accelerate does -- a collective before the first ``prepare`` must not run on one process alone."""
    from .._runtime.layout import plan_processes
    from .._runtime.spawn import ProcessGroupSession

    ctx = _layout.current()
    if ctx is not None:
        return ctx
    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    plan = plan_processes(detect_environment(), 1)
    ctx = plan.context(0, "cuda" if cuda else "cpu", torch.cuda.device_count() if cuda else 0)
    if plan.world_size > 1 and not plan.spawn and not (dist.is_available() and dist.is_initialized()):
        ProcessGroupSession(ctx, backend or ("nccl" if cuda else "gloo"),
                            host_store=plan.rank_offset == 0).start_for_process()
    return _layout.current() or ctx


_RESET = ("`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was called and an "
          "`Accelerator` or `PartialState` was not reinitialized.")


def describes_a_plan() -> bool:
    """Is this process's state only a description -- no worker running here, no process group joined (the process
    that spawns the workers, or a notebook) -- so that each Accelerator made here may describe its own plan?"""
    return _layout.current() is None and not (dist.is_available() and dist.is_initialized())


class PartialState:
    """Who this process is -- index, local index, device, number of processes -- and the process-level helpers
    (``wait_for_everyone``, ``main_process_first``, ``split_between_processes``, ``on_main_process`` ...). One
    shared state per process: every instance sees the same; the first one joins the process group."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        running, given = _layout.current(), kwargs.get("_context")
        if self.__dict__.get("initialized") and running is not None and self.__dict__.get("ctx") is not running:
            self.__dict__.clear()  # made before this worker started (a forked parent's): describe this one
        elif self.__dict__.get("initialized") and describes_a_plan() and given is not None and \
                self.__dict__.get("ctx") != given:
            self.__dict__.clear()  # the launching process: another Accelerator's plan (nothing joined), now this one
        if not self.__dict__.get("initialized"):
            # an Accelerator passes who this process is (it joins, or spawns, by its own plan of nprocs)
            ctx = kwargs.get("_context") or join_process_group(kwargs.get("backend"), use_cuda=False if cpu else None)
            self.ctx = ctx
            self.device = torch.device(ctx.device)
            self.backend = kwargs.get("backend") or ("nccl" if self.device.type == "cuda" else "gloo")
            self.debug = False
            self.initialized = True

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()

    def __getattr__(self, name: str) -> Any:  # only called when a lookup failed: after a reset
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(_RESET.format(cls=type(self).__name__, name=name))

    # -------------------------------------------------------------- who
    num_processes = property(lambda self: self.ctx.world_size)
    process_index = property(lambda self: self.ctx.rank)
    local_process_index = property(lambda self: self.ctx.local_rank)
    is_main_process = property(lambda self: self.process_index == 0)
    is_local_main_process = property(lambda self: self.local_process_index == 0)
    is_last_process = property(lambda self: self.process_index == self.num_processes - 1)

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self) -> DistributedType:
        if self.num_processes == 1:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    @property
    def is_distributed(self) -> bool:
        return self.use_distributed and dist.is_initialized()

    # -------------------------------------------------------------- together
    def wait_for_everyone(self) -> None:
        if self.is_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield from self._first(self.is_local_main_process)

    def _first(self, first: bool) -> Iterator[None]:
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return self._only(function, lambda: self.is_last_process)

    def on_process(self, function: Callable[..., Any] | None = None, process_index: int | None = None) -> Any:
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable[..., Any] | None = None, local_process_index: int | None = None
                         ) -> Any:
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only(function: Callable[..., Any], runs: Callable[[], bool]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if runs() else None
        return wrapper

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """This process's contiguous share of ``inputs`` (a list, tuple, tensor, dict of them, or a dataset), the
        first processes taking one more when it does not divide; with ``apply_padding`` every share has the same
        length, the last item repeated (``gather_object`` then drops what is past the length)."""
        yield split_for_process(inputs, self.process_index, self.num_processes, apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def destroy_process_group(self, group: Any = None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        backend = f"  Backend: {self.backend}" if self.is_distributed else ""
        return (f"Distributed environment: {self.distributed_type.value}{backend}\n"
                f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
                f"Local process index: {self.local_process_index}\nDevice: {self.device}\n")


def split_for_process(inputs: Any, index: int, count: int, pad: bool) -> Any:
    """The ``index``-th of ``count`` contiguous shares of ``inputs`` (see ``split_between_processes``)."""
    if count == 1:
        return inputs
    if isinstance(inputs, dict):
        return {k: split_for_process(v, index, count, pad) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, count)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    if pad:  # every share as long as the longest
        size = math.ceil(length / count)
        start, end = index * size, index * size + size
    if hasattr(inputs, "select") and not isinstance(inputs, (list, tuple, torch.Tensor)):  # a datasets.Dataset
        rows = list(range(start, min(end, length)))
        if pad and rows and len(rows) < end - start:
            rows += [rows[-1]] * (end - start - len(rows))
        return inputs.select(rows)
    share = inputs[start:min(end, length)]
    if pad and end > length:
        missing = end - max(start, length)
        if isinstance(inputs, torch.Tensor):
            share = torch.cat([share, *([inputs[-1:]] * missing)])
        else:
            share = list(share) + [inputs[-1]] * missing
            share = type(inputs)(share) if isinstance(inputs, tuple) else share
    return share


class AcceleratorState(PartialState):
    """``PartialState`` plus the training settings of the Accelerator that made it (``mixed_precision``,
    ``distributed_type`` FSDP under ``strategy="fsdp"``)."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, strategy: str = "ddp",
                 **kwargs: Any) -> None:
        partial = PartialState(cpu, **kwargs)
        self.__dict__ = self._shared_state
        self.__dict__.update(partial.__dict__)  # who this process is: always the PartialState's view
        if mixed_precision is not None or "mixed_precision" not in self.__dict__:
            self.mixed_precision = mixed_precision or "no"
        if strategy != "ddp" or "strategy" not in self.__dict__:  # an FSDP Accelerator's state says so
            self.strategy: str = strategy

    @property
    def distributed_type(self) -> DistributedType:
        if self.strategy in ("fsdp", "hsdp") and self.num_processes > 1:
            return DistributedType.FSDP
        return PartialState.distributed_type.fget(self)  # type: ignore[attr-defined]

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        self.strategy = "fsdp" if value == DistributedType.FSDP else "ddp"

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


class GradientState:
    """Where the current loop stands (Accelerate's ``GradientState``): whether this batch ends an accumulation
    window, which prepared loader is being iterated, whether its batch is the last and how many real samples the
    last global batch holds (``remainder``). Shared by every instance of the process."""

    _shared_state: dict[str, Any] = {}

    def __init__(self, gradient_accumulation_plugin: Any = None) -> None:
        self.__dict__ = self._shared_state
        if not self.__dict__.get("initialized"):
            self.dataloader_references: list[Any] = [None]
            self.plugin_kwargs: dict[str, Any] = {}
            self.initialized = True
        if gradient_accumulation_plugin is not None:
            self.plugin_kwargs = gradient_accumulation_plugin.to_dict()

    @classmethod
    def _reset_state(cls) -> None:
        cls._shared_state.clear()
        _loop.STATE.__init__()  # type: ignore[misc]

    num_steps = property(lambda self: self.plugin_kwargs.get("num_steps") or _loop.STATE.accumulation)
    adjust_scheduler = property(lambda self: self.plugin_kwargs.get("adjust_scheduler", True))
    sync_with_dataloader = property(lambda self: self.plugin_kwargs.get("sync_with_dataloader", True))
    sync_each_batch = property(lambda self: self.plugin_kwargs.get("sync_each_batch", False))
    in_dataloader = property(lambda self: self.active_dataloader is not None)

    @property
    def sync_gradients(self) -> bool:
        return _loop.STATE.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        _loop.STATE.sync_gradients = bool(value)

    @property
    def end_of_dataloader(self) -> bool:
        active = self.active_dataloader
        return bool(getattr(active, "end_of_dataloader", False)) if active is not None else False

    @property
    def remainder(self) -> int:
        active = self.active_dataloader
        return int(getattr(active, "remainder", -1)) if active is not None else -1

    @property
    def active_dataloader(self) -> Any:
        return self.dataloader_references[-1]

    def _add_dataloader(self, loader: Any) -> None:
        self.dataloader_references.append(loader)

    def _remove_dataloader(self, loader: Any) -> None:
        if loader in self.dataloader_references:
            self.dataloader_references.remove(loader)

    def _set_sync_gradients(self, value: bool) -> None:
        self.sync_gradients = value

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n")

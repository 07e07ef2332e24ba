"""`Accelerator`: one object that runs the same training code on 1 process, N local processes,
torchrun workers or Slurm tasks, on CPU (gloo) or GPU (nccl).

Example::

    from trainstack import Accelerator

    def train(model, loader, optimizer, accelerator):
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for xs, ys in loader:
            xs, ys = accelerator.prepare_batch((xs, ys))
            ...

    if __name__ == "__main__":
        acc = Accelerator(nprocs=2, compute_setup="cpu")
        acc.distribute(train)(model, loader, optimizer, acc)

    # python train.py                                 -> spawns 2 processes
    # torchrun --nproc_per_node 2 train.py            -> joins torchrun's 2 workers
    # srun --ntasks-per-node=2 python train.py        -> one Slurm task per process
    # srun --ntasks-per-node=1 python train.py        -> one task per node, each spawns its share of nprocs
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from ._accelerate import ops as _accelerate_ops
from ._accelerate.api import AccelerateAPI
from ._accelerate.config import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from ._accelerate.options import AccelerateOptions
from ._accelerate.state import AcceleratorState, GradientState
from ._common import envvars as envvars
from ._common.choices import BACKENDS, COMPUTE_SETUPS, DEFAULT_COMPUTE_SETUP, LOG_SETUPS, STRATEGIES
from ._runtime import collectives as collectives
from ._runtime import compiling
from ._runtime import layout as _layout
from ._runtime import loop as _loop
from ._runtime import preload as _preload
from ._runtime.identity import ProcessIdentity
from ._runtime.layout import WorkerContext
from ._runtime.parallel import Layout, Parallelism, plan_layout
from ._runtime.pgsession import can_abort
from ._runtime.placement import on_copy_stream
from ._runtime.spawn import ProcessGroupSession, launch
from ._runtime.startup import freeze_loaded
from ._runtime.watchdog import heartbeat, resolve_timeout, watched
from ._runtime.wrapping import wrap_model
from .data import DictDataLoader
from .environment import warn_if_outside_step
from .errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Accelerator", "notebook_launcher", "debug_launcher", "seed_everything", "set_seed"]

freeze_loaded()  # torch and the training modules are loaded: the collector stops scanning them (startup.py)

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

# complex model dtypes train on real-valued data of the matching precision
_DATA_DTYPE = {torch.complex128: torch.float64, torch.complex64: torch.float32, torch.complex32: torch.float16}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return
    np.random.seed(seed % 2**32)


def set_seed(seed: int, device_specific: bool = False) -> None:
    """HF Accelerate's ``set_seed``: Python, NumPy and torch; ``device_specific`` adds this process's rank."""
    ctx = _layout.current()
    seed_everything(seed + (ctx.rank if device_specific and ctx is not None else 0))


class Accelerator(AccelerateAPI):
    """Distributes a function over processes and prepares models, optimizers and data for them.

    HF Accelerate's constructor keywords and loop API work too (docs/migration/accelerate.md).

    Args:
        nprocs: total number of processes (all nodes). Under torchrun the launcher's count wins.
        compute_setup: ``"auto"`` (CUDA if available), ``"gpu"`` (CUDA required) or ``"cpu"``.
        log_setup: where reduced metrics live: ``"cpu"`` or ``"auto"`` (the compute device).
        dtype: model dtype; floating batch tensors are cast to it (complex dtypes use the real counterpart).
        backend: ``None`` picks nccl on GPU and gloo on CPU; ``"nccl"``, ``"gloo"`` or ``"mpi"`` explicitly.
        strategy: ``"ddp"``, ``"fsdp"`` or ``"hsdp"``; with ``hsdp_replicas``, ``tensor_parallel_size``,
            ``parallelize_fn`` and ``activation_checkpointing`` as TrainConfig's (docs/how-to/fsdp.md).
    """

    device_placement: bool
    mixed_precision: str
    gradient_accumulation_steps: int
    log_with: tuple[str, ...] | None
    project_dir: Path | None
    scaler: Any
    _prepared: dict[str, list[Any]]
    _trackers: Any

    def __init__(self, nprocs: int = 1, compute_setup: str = DEFAULT_COMPUTE_SETUP, log_setup: str = "cpu",
                 dtype: torch.dtype | None = None, backend: str | None = None, strategy: str = "ddp",
                 fsdp_blocks: Sequence[str] | None = None, fsdp_min_params: int = 1_000_000,
                 fsdp_param_dtype: torch.dtype | None = None, hang_timeout: float | None = None, *,
                 device_placement: bool = True, mixed_precision: str | None = None,
                 gradient_accumulation_steps: int = 1, cpu: bool = False, log_with: str | list[str] | None = None,
                 project_dir: str | os.PathLike | None = None, compile: bool | dict[str, Any] = False,
                 dataloader_config: DataLoaderConfiguration | None = None,
                 gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
                 project_config: ProjectConfiguration | None = None, kwargs_handlers: Sequence[Any] | None = None,
                 rng_types: Sequence[str] | None = None, step_scheduler_with_optimizer: bool = True,
                 join_process_group: bool = True, hsdp_replicas: int | None = None, tensor_parallel_size: int = 1,
                 parallelize_fn: Callable[..., Any] | None = None,
                 activation_checkpointing: str | Callable[[nn.Module], bool] | None = None, float8: bool = False,
                 **unknown: Any) -> None:
        if unknown:
            _loop.refuse_keywords(unknown)
        compute_setup = "cpu" if cpu else compute_setup
        _check_arguments(nprocs, compute_setup, log_setup, backend, dtype, strategy, fsdp_blocks)
        self.hang_timeout = resolve_timeout(hang_timeout)
        self.compile_options = compiling.compile_options(compile, "Accelerator(compile=)")
        self.strategy, self.fsdp_blocks = strategy, tuple(fsdp_blocks) if fsdp_blocks else None
        self.fsdp_min_params, self.fsdp_param_dtype = fsdp_min_params, fsdp_param_dtype
        self.parallelism = Parallelism(hsdp_replicas, tensor_parallel_size, parallelize_fn, activation_checkpointing,
                                       float8)
        self.parallelism.check_strategy(strategy)
        self.device_mesh: DeviceMesh | None = None  # the mesh the last prepared model was laid out on
        self.nprocs = nprocs
        self.compute_setup = compute_setup
        self.log_setup = log_setup
        self.dtype = dtype
        self.data_dtype = _DATA_DTYPE.get(dtype, dtype) if dtype is not None else None
        self.use_cuda = _resolve_cuda(compute_setup)
        self.backend = _resolve_backend(backend, self.use_cuda, compute_setup)
        self.identity = ProcessIdentity(nprocs, self.use_cuda, compute_setup)  # the plan, this process, its device
        options = AccelerateOptions.check(
            device_placement=device_placement, mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps, log_with=log_with, project_dir=project_dir,
            dataloader_config=dataloader_config, gradient_accumulation_plugin=gradient_accumulation_plugin,
            project_config=project_config, kwargs_handlers=kwargs_handlers, rng_types=rng_types,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer, use_cuda=self.use_cuda)
        self.device_placement, self.mixed_precision = options.device_placement, options.mixed_precision
        self.gradient_accumulation_steps, self.log_with = options.gradient_accumulation_steps, options.log_with
        self.project_configuration, self.dataloader_config = options.project_config, options.dataloader_config
        self.project_dir = Path(options.project_dir) if options.project_dir is not None else None
        self.rng_types, self.handlers = options.rng_types, options.handlers
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        GradientState(options.gradient_accumulation_plugin)
        self.scaler = None  # fp16's GradScaler, made when the first optimizer is prepared
        self._prepared = {"model": [], "optimizer": [], "scheduler": [], "loader": [], "custom": []}
        self._trackers = None
        self._trigger = False
        self._state: AcceleratorState | None = None
        self._session: ProcessGroupSession | None = None
        if join_process_group:  # as Accelerate does: a collective before the first prepare() is not one-sided
            self._join_now()
            _ = self.state  # this Accelerator's view of the shared state (a reset of it is then an error)
        _preload.start_for(nprocs)  # workers will fork from it: its torch import overlaps the script's set-up

    # ------------------------------------------------------------------ set-up
    def _join_now(self) -> None:
        """Join the launcher's process group (torchrun, srun per process) at construction; nothing to join when
        this process will spawn the workers or is one of them."""
        if _layout.current() is not None or dist.is_initialized():
            return
        plan = self.plan
        if plan.spawn or plan.world_size == 1:
            return
        self._session = ProcessGroupSession(self._ctx(), self.backend, host_store=plan.rank_offset == 0,
                                            timeout_s=self.handlers.timeout_s)
        self._session.start_for_process()

    @property
    def restarts_in_place(self) -> bool:
        """Can a rank of this run join a new group after losing a peer (``rejoin``): srun, a backend that can leave
        a failed group, and a model whose every shard has a copy -- DDP, or HSDP over several replica groups on gloo
        (whose connections a leaving rank can close: a peer blocked on it fails; NCCL's: unchecked on a GPU)."""
        p = self.parallelism
        copies = self.strategy == "ddp" or \
            self.strategy == "hsdp" and self.backend == "gloo" and self.layout.replicate > 1
        return copies and p.tensor_parallel_size == 1 and p.parallelize_fn is None and not self.plan.spawn and \
            can_abort(self.backend) and self.plan.environment.name == "slurm"

    def rejoin(self, env: Mapping[str, str]) -> None:
        """Leave the failed process group and take the next job step's rendezvous and counters (``env``: an Offer's):
        joined again at once where this Accelerator joined at construction, else by the next distributed call."""
        joined, self._session = self._session, None
        if joined is not None:
            joined.stop(ok=False)
        os.environ.update(env)
        self.identity.forget()
        if joined is not None:
            self._join_now()

    plan = property(lambda self: self.identity.plan, doc="The process layout here (``ProcessIdentity``: once).")

    def __getstate__(self) -> dict[str, Any]:
        # This process's handles and objects stay here (the identity pickles none of the launching process's).
        return {**self.__dict__, "_trackers": None, "_state": None,
                "_session": None, "_prepared": {k: [] for k in self.__dict__.get("_prepared", {})}}

    # ------------------------------------------------------------------ identity
    def _ctx(self) -> WorkerContext:
        """Who this process is: the running worker, else the first process of the plan (``ProcessIdentity``)."""
        return self.identity.context()

    @property
    def rank(self) -> int:
        return self._ctx().rank

    @property
    def local_rank(self) -> int:
        return self._ctx().local_rank

    @property
    def world_size(self) -> int:
        return self._ctx().world_size

    node_rank = property(lambda self: self._ctx().node_rank, doc="This process's node (0 .. num_nodes - 1).")
    num_nodes = property(lambda self: self._ctx().num_nodes, doc="The nodes of the run.")

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    is_local_main_process = property(lambda self: self.local_rank == 0, doc="The first process of its node.")

    device = property(lambda self: self.identity.device(), doc="This process's ``torch.device`` (built once).")

    @property
    def pin_memory(self) -> bool:
        """Pin prepared loaders' batches on CUDA (asynchronous copies); ``TRAINSTACK_PIN_MEMORY=0`` turns it off."""
        return self.use_cuda and os.environ.get(envvars.PIN_MEMORY, "1") != "0"

    log_device = property(lambda self: self.device if self.log_setup == "auto" else torch.device("cpu"),
                          doc="Where reduced metrics live (``log_setup``).")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ launching
    def distribute(self, fn: F, keep_open: Sequence[int] = (), interruptible: bool = False) -> F:
        """Wrap ``fn`` so that calling it runs it on every process; returns rank 0's return value.

        Spawns workers only when the environment started fewer processes than ``nprocs``; inside
        torchrun/srun-per-process it joins the existing processes instead. ``keep_open``: file descriptors the
        spawned workers hold until they exit (a lock stays held while any of them lives). ``interruptible``: ``fn``
        stops gracefully at a first Ctrl-C (the Trainer), which the launching process passes on.
        """

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._session is not None:  # joined at construction: watched, in the group it already has
                ctx = self._ctx()
                with watched(ctx.rank, ctx.world_size, self.hang_timeout, Path(self._hang_dir())):
                    return fn(*args, **kwargs)
            if _layout.current() is not None:  # already inside a worker: never spawn again
                return fn(*args, **kwargs)
            warn_if_outside_step()
            plan = self.plan
            hang_dir = self._hang_dir()
            if plan.spawn:
                return launch(fn, args, kwargs, plan, self.backend, self.identity.device_type, self.hang_timeout,
                              hang_dir, keep_open, interruptible, timeout_s=self.handlers.timeout_s)
            ctx = self._ctx()
            with ProcessGroupSession(ctx, self.backend, host_store=plan.rank_offset == 0,
                                     timeout_s=self.handlers.timeout_s), \
                    watched(ctx.rank, ctx.world_size, self.hang_timeout, Path(hang_dir)):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _hang_dir(self) -> str:
        """Where a hang's stack dump goes: the job's folder, the project folder, else here."""
        return os.environ.get(envvars.HANG_DIR) or str(self.project_dir or os.environ.get(envvars.JOB_DIR) or ".")

    def setup(self) -> None:
        """Join the process group when running under torchrun/srun without ``distribute`` (idempotent)."""
        if _layout.current() is not None:
            return
        plan = self.plan
        if plan.spawn:
            raise LaunchError(
                f"Accelerator(nprocs={self.nprocs}) needs to start {plan.nprocs_local} processes, which only "
                f"distribute() can do. HINT: call accelerator.distribute(train_fn)(...) or launch the script "
                f"with torchrun --nproc_per_node {self.nprocs}.")
        if plan.world_size > 1:
            ProcessGroupSession(self._ctx(), self.backend, host_store=plan.rank_offset == 0,
                                timeout_s=self.handlers.timeout_s).start_for_process()

    # ------------------------------------------------------------------ preparing objects
    def prepare(self, *objs: Any, compile: bool | dict[str, Any] | None = None) -> Any:
        """Move models to the device (compiled when asked, DDP-wrapped when world > 1), shard DataLoaders; optimizers
        keep optimizing the prepared model's parameters; others pass through. One object for one argument, else a
        tuple. ``compile`` overrides the Accelerator's."""
        if compile is not None:
            self.compile_options = compiling.compile_options(compile, "prepare(compile=)")
        self.setup()
        self._check_state()
        plugin = self.gradient_state
        _loop.STATE.configure(self.gradient_accumulation_steps, plugin.sync_each_batch and self.use_distributed,
                              plugin.sync_with_dataloader)
        moved: dict[int, nn.Parameter] = {}
        out = [self._prepare_one(obj, moved) for obj in objs]
        for i, obj in enumerate(out):
            if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, _loop.PreparedOptimizer):
                retarget_optimizer(obj, moved)
                out[i] = self._wrap_optimizer(obj)
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
                out[i] = _loop.PreparedScheduler(obj, 1 if self.split_batches else self.world_size,
                                                 follow_optimizer=self.step_scheduler_with_optimizer)
                self._prepared["scheduler"].append(obj)
        return out[0] if len(out) == 1 else tuple(out)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """A step that counts, and that accumulation can skip and fp16 can scale (still a torch Optimizer)."""
        self._prepared["optimizer"].append(optimizer)
        if self.mixed_precision == "fp16" and self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.device.type, **self.handlers.scaler.to_kwargs())
        if self.gradient_accumulation_steps > 1 or self.scaler is not None:
            return _loop.PreparedOptimizer(optimizer, self.scaler)
        optimizer.register_step_post_hook(_loop.count_step)  # the optimizer itself (qadence: `is` holds)
        return optimizer

    def _prepare_one(self, obj: Any, moved: dict[int, nn.Parameter]) -> Any:
        if isinstance(obj, nn.Module):
            self._prepared["model"].append(obj)
            model = self.prepare_model(obj, moved)
            dtype = _loop.autocast_dtype(self.mixed_precision)
            if dtype is not None:  # as Accelerate does: the forward runs under autocast, outputs come back in fp32
                _loop.autocast_forward(model, self.device.type, dtype)
            return model
        if isinstance(obj, DictDataLoader):
            return obj.prepared(lambda dl: self._prepare_one(dl, moved))
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj)
        return obj

    @property
    def layout(self) -> Layout:
        """This world as data-parallel replicas x shards x tensor-parallel ranks (``strategy``, ``hsdp_replicas``,
        ``tensor_parallel_size``; HSDP's replicas default to the nodes)."""
        p = self.parallelism
        return plan_layout(self.strategy, self.world_size, self.num_nodes, p.hsdp_replicas, p.tensor_parallel_size)

    def prepare_model(self, model: nn.Module, moved: dict[int, nn.Parameter] | None = None) -> nn.Module:
        """To the device and dtype; the parallelize hook (tensor parallelism) and activation checkpointing; compiled
        in place when asked; then DDP (a wrapper) or FSDP/HSDP (``fully_shard`` in place over the mesh) when
        world > 1; ``moved`` collects old parameter id -> new parameter (optimizers follow)."""
        wrapped, mesh, laid_out = wrap_model(model, self, moved)
        if laid_out:
            self.device_mesh = mesh
        return wrapped

    def forget_mesh(self) -> None:
        """Let go of the mesh the last model was laid out on (its groups failed: held, they stay connected)."""
        self.device_mesh = None

    def prepare_batch(self, batch: Any) -> Any:
        """Move a (nested) batch to the device; floating tensors are cast to ``dtype``, labels never."""
        device = self.device
        if device.type == "cpu" and self.data_dtype is None:
            return batch  # nothing to move or cast: the raw loop does no work here either
        if device.type == "cuda":  # the copy beside the step before, not behind it (_runtime/placement.py)
            return on_copy_stream(batch, device, lambda b: _move(b, device, self.data_dtype, self.dtype))
        return _move(batch, device, self.data_dtype, self.dtype)

    # ------------------------------------------------------------------ collectives
    def all_reduce_dict(self, d: dict[str, Any], op: str = "mean") -> dict[str, Any]:
        """Reduce every value across ranks (``mean|sum|max|min``) in one collective; identity when world = 1."""
        return collectives.all_reduce_dict(d, op, self.log_device if self.backend != "nccl" else self.device,
                                           self.log_device)

    def gather(self, tensor: Any) -> Any:
        """Every rank's tensors concatenated along dim 0, in rank order (sizes of dim 0 may differ); a tuple, list
        or dict of tensors is gathered leaf by leaf."""
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        return _accelerate_ops.apply_to_tensors("gather", lambda t: collectives.gather(t, device), tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send ``obj`` (a tensor or any picklable object) from rank ``src`` to every rank."""
        return collectives.broadcast(obj, src, self.device if self.backend == "nccl" else torch.device("cpu"))

    def heartbeat(self, step: int | None = None, phase: str | None = None) -> None:
        """Progress for the hang watchdog (custom loops): ``step`` (default: one more), ``phase`` (e.g. "forward")."""
        hb = heartbeat()
        hb.step, hb.tick, hb.beats = hb.step + 1 if step is None else step, hb.tick + 1, hb.beats + 1
        hb.phase = phase or hb.phase

    def barrier(self) -> None:  # also Accelerate's wait_for_everyone
        if self.is_distributed:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on rank 0 first (e.g. to download/cache data), then on the other ranks."""
        if not self.is_main_process:
            self.barrier()
        yield
        if self.is_main_process:
            self.barrier()

    @staticmethod
    def unwrap_model(model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
                     ) -> nn.Module:
        """The user's module inside DDP and ``torch.compile`` (or the module itself). Mixed precision stays on its
        forward unless ``keep_fp32_wrapper=False``; ``keep_torch_compile`` is accepted (the compiled module is the
        user's own, compiled in place)."""
        inner = compiling.unwrap_compiled(model.module if isinstance(model, DistributedDataParallel) else model)[0]
        if not keep_fp32_wrapper:
            _loop.remove_autocast_forward(inner)
        return inner

    seed_everything = staticmethod(seed_everything)

    def __repr__(self) -> str:
        return (f"Accelerator(nprocs={self.nprocs}, compute_setup={self.compute_setup!r}, backend={self.backend!r}, "
                f"device={self.device}, rank={self.rank}, world_size={self.world_size})")


def notebook_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | int = "29500", **ignored: Any) -> Any:
    """HF Accelerate's launcher: run ``function(*args)`` on ``num_processes`` processes (default: one per visible
    GPU, else 1) with trainstack's launcher -- from a notebook or a script -- and return rank 0's result.
    ``mixed_precision`` belongs to the Accelerator inside ``function``; the port is chosen free (``use_port`` is
    accepted and ignored: a fixed port collides with another run)."""
    if mixed_precision != "no":
        raise ConfigError(f"notebook_launcher(mixed_precision={mixed_precision!r}): give it to the Accelerator "
                          f"inside your function: Accelerator(mixed_precision={mixed_precision!r}).")
    unknown = set(ignored) - {"master_addr", "node_rank", "num_nodes", "rdzv_backend", "rdzv_endpoint",
                              "rdzv_conf", "rdzv_id", "max_restarts", "monitor_interval", "log_line_prefix_template"}
    if unknown:
        raise ConfigError(f"notebook_launcher got an unknown keyword {sorted(unknown)[0]!r}.")
    nprocs = num_processes or max(torch.cuda.device_count(), 1)
    return Accelerator(nprocs=nprocs).distribute(function)(*args)


def debug_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2) -> Any:
    """HF Accelerate's ``debug_launcher``: ``function(*args)`` on ``num_processes`` CPU processes (distributed code
    checked on a laptop), rank 0's result returned."""
    return Accelerator(nprocs=num_processes, compute_setup="cpu").distribute(function)(*args)


def _resolve_cuda(compute_setup: str) -> bool:
    if compute_setup == "cpu":
        return False
    available = torch.cuda.is_available()
    if compute_setup == "gpu" and not available:
        raise ConfigError("compute_setup='gpu' but no CUDA device is visible. HINT: use compute_setup='cpu' "
                          "(or 'auto'), or check CUDA_VISIBLE_DEVICES and the driver (trainstack doctor).")
    return available


def _resolve_backend(backend: str | None, use_cuda: bool, compute_setup: str) -> str:
    if backend is None:
        return "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ConfigError(
            f"backend='nccl' needs CUDA GPUs, but compute_setup={compute_setup!r} runs on the CPU here "
            f"(no CUDA device is visible). HINT: use backend='gloo' (or backend=None to choose automatically) "
            f"on CPU-only machines, e.g. --backend gloo --compute_setup cpu.")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ConfigError("backend='mpi' but this torch build has no MPI support. HINT: use 'gloo' or 'nccl'.")
    return backend


def _check_arguments(nprocs: int, compute_setup: str, log_setup: str, backend: str | None, dtype: Any,
                     strategy: str, fsdp_blocks: Any) -> None:
    """The constructor's arguments, each checked with a message naming it."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"nprocs={nprocs!r}: must be an integer >= 1 (total number of processes).")
    if compute_setup not in COMPUTE_SETUPS:
        raise ConfigError(f"compute_setup={compute_setup!r}: must be one of {COMPUTE_SETUPS}.")
    if log_setup not in LOG_SETUPS:
        raise ConfigError(f"log_setup={log_setup!r}: must be one of {LOG_SETUPS}.")
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: must be one of {BACKENDS} (None chooses for you).")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype={dtype!r}: must be a torch.dtype such as torch.float32, or None.")
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: must be one of {STRATEGIES} (ddp: a full copy per process; "
                          f"fsdp: parameters, gradients and optimizer state sharded across processes; hsdp: "
                          f"sharded within a node, replicated across nodes).")
    if fsdp_blocks is not None and (isinstance(fsdp_blocks, str) or not all(isinstance(b, str)
                                                                            for b in fsdp_blocks)):
        raise ConfigError(f"fsdp_blocks={fsdp_blocks!r}: must be a tuple of module class names, e.g. "
                          f"('TransformerEncoderLayer',).")

def retarget_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, nn.Parameter]) -> None:
    """Point the optimizer at moved parameters and move its state next to them."""
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    for param, st in list(optimizer.state.items()):
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.device != param.device and key != "step":
                st[key] = value.to(param.device)
    if moved:
        state: Any = collections.defaultdict(dict)
        state.update({moved.get(id(p), p): s for p, s in optimizer.state.items()})
        optimizer.state = state


def _move(obj: Any, device: torch.device, data_dtype: torch.dtype | None, dtype: torch.dtype | None) -> Any:
    if isinstance(obj, torch.Tensor):
        target = None
        if data_dtype is not None and obj.is_floating_point():
            target = data_dtype
        elif dtype is not None and obj.is_complex() and dtype.is_complex:
            target = dtype
        # non_blocking for every host-to-GPU copy: a pageable source is staged by the driver before the call
        # returns, so this is safe, and the host never waits for the GPU (a blocking copy syncs the stream)
        return obj.to(device=device, dtype=target, non_blocking=device.type == "cuda")
    if isinstance(obj, dict):
        moved = {k: _move(v, device, data_dtype, dtype) for k, v in obj.items()}
        return moved if type(obj) is dict else _rebuild(obj, moved)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move(v, device, data_dtype, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, data_dtype, dtype) for v in obj)
    return obj


def _rebuild(original: dict, moved: dict) -> dict:
    """Keep a dict subclass (OrderedDict, BatchEncoding-like) when its constructor allows it."""
    try:
        return type(original)(moved)
    except TypeError:
        return moved

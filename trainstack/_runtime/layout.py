"""The process layout of one run: how many processes run where (``ProcessPlan``), and who this process is
(``WorkerContext``, built in one place: ``ProcessPlan.context``).

    ClusterEnvironment (what the launcher says)  ->  ProcessPlan (+ the user's nprocs)  ->  WorkerContext per process

``current`` is the identity of the running worker, set for the lifetime of its process group.
Torch-free, so the CLI can import it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..environment import ClusterEnvironment
from ..errors import LaunchError

__all__ = ["WorkerContext", "ProcessPlan", "plan_processes", "current", "activate", "deactivate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerContext:
    """Who this process is: its ranks, where the group meets, and its device (``"cpu"`` or ``"cuda:<i>"``)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    environment: str = "local"  # who started the processes: local, torchrun or slurm (environment.py's names)
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class ProcessPlan:
    """How the processes of one run are laid out, seen from the launching process.

    ``nprocs_local`` processes run here (in-process when ``spawn`` is False), with global ranks
    ``rank_offset .. rank_offset + nprocs_local - 1`` and local ranks from ``local_rank_offset``.
    """

    environment: ClusterEnvironment
    world_size: int
    nprocs_local: int
    rank_offset: int
    local_rank_offset: int
    local_world_size: int
    spawn: bool
    hosts_store: bool  # this (launching) process hosts the rendezvous TCPStore

    @property
    def master_addr(self) -> str:
        return self.environment.master_addr

    @property
    def master_port(self) -> int:
        return self.environment.master_port

    def context(self, local_index: int = 0, device_type: str = "cpu", gpus: int = 0,
                port: int | None = None) -> WorkerContext:
        """The identity of the ``local_index``-th process of this plan; ``gpus`` visible CUDA devices."""
        local_rank = self.local_rank_offset + local_index
        device = f"cuda:{local_rank % max(gpus, 1)}" if device_type == "cuda" else "cpu"
        env = self.environment
        return WorkerContext(rank=self.rank_offset + local_index, local_rank=local_rank, world_size=self.world_size,
                             local_world_size=self.local_world_size, node_rank=env.node_rank,
                             num_nodes=env.num_nodes, master_addr=self.master_addr,
                             master_port=self.master_port if port is None else port, environment=env.name,
                             device=device)


def plan_processes(env: ClusterEnvironment, nprocs: int) -> ProcessPlan:
    """Combine what the launcher started with the user's ``nprocs``; mismatches are clear errors.

    * local: spawn ``nprocs`` processes here (none when ``nprocs == 1``).
    * torchrun: the launcher decides; an ``nprocs`` other than 1 or the world size is ignored with a warning
      (the same script runs under ``python train.py --nprocs N`` and ``torchrun --nproc_per_node G``).
    * slurm, one task per process (``srun`` with ``--ntasks-per-node=G``): ``nprocs`` is 1 or ``SLURM_NTASKS``.
    * slurm, one task per node that spawns its share (``srun python train.py --nprocs N`` with
      ``--ntasks=<nodes>``): ``nprocs`` must be a multiple of the task count; global rank = task * k + i.
    * a job script trainstack generated says how many processes the job was allocated (``TRAINSTACK_NPROCS``):
      that count wins over the program's ``nprocs`` (with a warning when they differ), so a program's default can
      never leave GPUs of the allocation idle.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs={nprocs!r} must be a positive integer (the total number of processes).")
    if env.name == "local":
        return ProcessPlan(env, nprocs, nprocs, 0, 0, nprocs, spawn=nprocs > 1, hosts_store=nprocs > 1)
    world = env.world_size
    if env.name == "slurm" and env.allocated and nprocs != env.allocated:
        if nprocs != 1 and env.rank == 0:
            log.warning("nprocs=%d ignored: this job was allocated %d processes (TRAINSTACK_NPROCS, set by the job "
                        "script).", nprocs, env.allocated)
        nprocs = env.allocated
    if env.name == "torchrun" or nprocs in (1, world):
        if nprocs not in (1, world) and env.rank == 0:  # once, not once per process
            log.warning("nprocs=%d ignored: %s started %d processes.", nprocs, env.name, world)
        return ProcessPlan(env, world, 1, env.rank, env.local_rank, env.local_world_size,
                           spawn=False, hosts_store=False)
    if nprocs % world != 0:
        raise LaunchError(
            f"nprocs={nprocs} is not a multiple of the {world} Slurm tasks of this step, so the processes "
            f"cannot be split evenly. HINT: use one task per node (--ntasks-per-node=1) with nprocs a multiple "
            f"of the node count, or one task per process (--ntasks-per-node=G) with nprocs={world}.")
    per_task = nprocs // world
    return ProcessPlan(env, nprocs, per_task, env.rank * per_task, env.local_rank * per_task,
                       env.local_world_size * per_task, spawn=True, hosts_store=env.rank == 0)


_current: WorkerContext | None = None


def current() -> WorkerContext | None:
    """The identity of this worker while its process group is up; None outside a distributed run."""
    return _current


def activate(ctx: WorkerContext) -> None:
    global _current
    _current = ctx


def deactivate() -> None:
    global _current
    _current = None

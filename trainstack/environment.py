"""Who am I? Small read-only records of what the launcher that started this process says.

Each environment parses an explicit mapping (``os.environ`` by default), so tests pass dicts.
``detect_environment`` tries them in this priority order:

1. ``TorchrunEnvironment`` -- ``torchrun`` (``TORCHELASTIC_RUN_ID``) or any env:// launcher that
   sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. It outranks Slurm
   because ``srun torchrun ...`` sets both, and torchrun's variables describe the worker processes
   while Slurm's describe the per-node torchrun agents.
2. ``SlurmEnvironment`` -- inside an ``srun`` job step (``SLURM_STEP_ID`` plus ``SLURM_PROCID``).
   The batch shell of an sbatch job also has ``SLURM_PROCID=0`` but is not a step; a plain ``python``
   there is treated as local (with a warning), so it never waits for tasks that do not exist.
3. ``LocalEnvironment`` -- anything else: a laptop, a notebook, a login node.

``trainstack._runtime.layout.plan_processes`` then combines the environment with the user's ``nprocs``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import hostlist

from ._common import envvars as envvars
from ._common.choices import PORT_BASE, PORT_SPAN
from .errors import LaunchError

__all__ = [
    "ClusterEnvironment",
    "LocalEnvironment",
    "TorchrunEnvironment",
    "SlurmEnvironment",
    "detect_environment",
    "expand_nodelist",
    "port_from_job_id",
    "PORT_BASE",
    "PORT_SPAN",
]

log = logging.getLogger(__name__)



def port_from_job_id(job_id: str | int) -> int:
    """The deterministic rendezvous port for a Slurm job (``61000 + job_id % 4536``)."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``node[01-03,7]`` or ``gpu-a[1-2],gpu-b3`` (python-hostlist)."""
    try:
        return hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise LaunchError(f"cannot parse Slurm node list {nodelist!r}: {exc}") from None


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    """Read the first present variable of ``names`` as an int, or fail naming the variable and value."""
    for name in names:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise LaunchError(f"environment variable {name}={raw!r} is not an integer. "
                              f"HINT: unset it or let the launcher set it.") from None
    if default is None:
        raise LaunchError(f"environment variable {names[0]} is not set; the launcher should set it.")
    return default


@dataclass(frozen=True)
class ClusterEnvironment:
    """What the launcher says about this process. ``world_size`` counts launcher-started processes."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port when spawning locally
    job_id: str | None = None
    restart_count: int = 0
    nodes: tuple[str, ...] = field(default=())
    allocated: int | None = None  # processes the job script was generated for (TRAINSTACK_NPROCS), if any

    name: ClassVar[str] = "base"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        raise NotImplementedError

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ClusterEnvironment:
        raise NotImplementedError

    @property
    def launched_externally(self) -> bool:
        """True when a launcher (torchrun, srun) created the processes, so we must not spawn per rank."""
        return self.name != "local"

    def __post_init__(self) -> None:
        checks = [
            (self.world_size >= 1, f"world size {self.world_size} < 1"),
            (0 <= self.rank < self.world_size, f"rank {self.rank} not in [0, {self.world_size})"),
            (0 <= self.local_rank < max(self.local_world_size, 1),
             f"local rank {self.local_rank} not in [0, {self.local_world_size})"),
            (0 <= self.node_rank < max(self.num_nodes, 1), f"node rank {self.node_rank} not in [0, {self.num_nodes})"),
        ]
        for ok, what in checks:
            if not ok:
                raise LaunchError(f"{self.name} environment is inconsistent: {what}. "
                                  f"HINT: check the launcher variables ({self.describe()}).")

    def describe(self) -> str:
        return (f"{self.name}: rank={self.rank} world_size={self.world_size} local_rank={self.local_rank} "
                f"node_rank={self.node_rank}/{self.num_nodes} master={self.master_addr}:{self.master_port}")


@dataclass(frozen=True)
class LocalEnvironment(ClusterEnvironment):
    """No launcher: this process is alone and spawns workers itself when asked for ``nprocs > 1``."""

    name: ClassVar[str] = "local"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LocalEnvironment:
        return cls(master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
                   master_port=_int(environ, "MASTER_PORT", default=0))


@dataclass(frozen=True)
class TorchrunEnvironment(ClusterEnvironment):
    """``torchrun`` (torch.distributed.run) or another launcher that sets the env:// variables."""

    name: ClassVar[str] = "torchrun"
    _REQUIRED: ClassVar[tuple[str, ...]] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ or all(k in environ for k in cls._REQUIRED)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TorchrunEnvironment:
        world = _int(environ, "WORLD_SIZE")
        local_world = _int(environ, "LOCAL_WORLD_SIZE", default=world)
        return cls(
            world_size=world,
            rank=_int(environ, "RANK"),
            local_rank=_int(environ, "LOCAL_RANK"),
            local_world_size=local_world,
            node_rank=_int(environ, "GROUP_RANK", default=0),
            num_nodes=_int(environ, "GROUP_WORLD_SIZE", default=max(world // max(local_world, 1), 1)),
            master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
            master_port=_int(environ, "MASTER_PORT", default=29500),
            job_id=environ.get("TORCHELASTIC_RUN_ID"),
            restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
        )


@dataclass(frozen=True)
class SlurmEnvironment(ClusterEnvironment):
    """An ``srun`` job step: one process per Slurm task. Step-scoped variables win over job-scoped ones."""

    name: ClassVar[str] = "slurm"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
        return in_step and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SlurmEnvironment:
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if environ.get(envvars.TASK_RANKS):
            return cls._beside_survivors(environ, environ[envvars.TASK_RANKS], job_id)
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
            or environ.get("SLURM_NODELIST") or ""
        nodes = tuple(expand_nodelist(nodelist)) if nodelist else ()
        node_rank = _int(environ, "SLURM_NODEID", default=0)
        world = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        num_nodes = _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                         default=len(nodes) or 1)
        master_addr = environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
        if "MASTER_PORT" in environ:
            port = _int(environ, "MASTER_PORT")
        else:
            port = port_from_job_id(job_id) if job_id else 0
        return cls(
            world_size=world,
            rank=_int(environ, "SLURM_PROCID"),
            local_rank=_int(environ, "SLURM_LOCALID", default=0),
            local_world_size=_tasks_on_node(environ, node_rank, world, num_nodes),
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=port,
            job_id=job_id,
            restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0),
            nodes=nodes,
            allocated=_int(environ, envvars.NPROCS, default=0) or None,
        )


    @classmethod
    def _beside_survivors(cls, environ: Mapping[str, str], listed: str, job_id: str | None) -> SlurmEnvironment:
        """A job step that starts some ranks of a world whose other ranks restart in place (the allocation
        driver's ``TRAINSTACK_TASK_RANKS=PER_NODE/r1,r2``): this task's global rank, its place in the block layout
        (rank // PER_NODE is its node), the world from ``TRAINSTACK_NPROCS``."""
        try:
            per_text, ranks_text = listed.split("/", 1)
            per, ranks = int(per_text), [int(r) for r in ranks_text.split(",")]
            rank, world = ranks[_int(environ, "SLURM_PROCID")], _int(environ, envvars.NPROCS)
            if not (0 < per <= 4096 and 0 <= rank < world <= 1 << 20):  # as an offer's per_node: the reader checks
                raise ValueError(listed)
        except (ValueError, IndexError):
            raise LaunchError(f"{envvars.TASK_RANKS}={listed!r} (SLURM_PROCID={environ.get('SLURM_PROCID')!r}): "
                              f"expected PER_NODE/RANK,RANK... with one rank per srun task, set by trainstack's "
                              f"allocation driver, and {envvars.NPROCS} the world") from None
        return cls(world_size=world, rank=rank, local_rank=rank % per, local_world_size=per, node_rank=rank // per,
                   num_nodes=max(world // per, 1), master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
                   master_port=_int(environ, "MASTER_PORT"), job_id=job_id,
                   restart_count=_int(environ, "SLURM_RESTART_COUNT", default=0), nodes=(), allocated=world)


def _tasks_on_node(environ: Mapping[str, str], node_rank: int, world: int, num_nodes: int) -> int:
    """Tasks on this node from ``SLURM_STEP_TASKS_PER_NODE``-style strings such as ``2(x3),1``."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = environ.get(name)
        if raw:
            try:
                counts = hostlist.parse_slurm_tasks_per_node(raw)
            except Exception:
                raise LaunchError(f"cannot parse {name}={raw!r}; expected a Slurm list such as '2(x3),1'") from None
            if node_rank < len(counts):
                return counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _int(environ, "SLURM_NTASKS_PER_NODE")
    return max(world // max(num_nodes, 1), 1)


#: Tried in order; the first whose ``detect`` is true wins. See the module docstring for why.
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (TorchrunEnvironment, SlurmEnvironment, LocalEnvironment)


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Return the environment of the current process (``environ`` defaults to ``os.environ``)."""
    env = os.environ if environ is None else environ
    for cls in ENVIRONMENTS:
        if cls.detect(env):
            return cls.from_environ(env)
    raise AssertionError("LocalEnvironment always matches")  # pragma: no cover


def warn_if_outside_step(environ: Mapping[str, str] | None = None) -> None:
    """Warn when running in an sbatch shell of a multi-node job without ``srun`` (only this node works)."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" in env and not SlurmEnvironment.detect(env) and not TorchrunEnvironment.detect(env):
        nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
        if nodes != "1":
            log.warning("Running inside Slurm job %s (%s nodes) but not in an srun step: only this node is used. "
                        "HINT: launch with 'srun python ...'.", env["SLURM_JOB_ID"], nodes)

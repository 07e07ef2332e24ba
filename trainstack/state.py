"""The distributed identity of the current process (set once per worker, read by every Accelerator)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WorkerContext", "current", "activate", "deactivate"]


@dataclass(frozen=True)
class WorkerContext:
    """Rank layout of one running process. ``launcher`` is ``local``, ``torchrun`` or ``slurm``."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    launcher: str = "local"


_current: WorkerContext | None = None


def current() -> WorkerContext | None:
    """The active context, or None outside a distributed run."""
    return _current


def activate(ctx: WorkerContext) -> None:
    global _current
    _current = ctx


def deactivate() -> None:
    global _current
    _current = None

"""A warm standby: an interpreter on a node of a ``--requeue`` allocation that has already imported torch and
trainstack and waits to become a rank (``python -m trainstack._runtime.standby NAME -- PROGRAM...``).

A rank that must start afresh -- a crash's replacement, a spare's ranks, a whole step relaunched -- costs its
interpreter's imports (2-5 s of CPU: torch, dynamo, trainstack) before it can join the group. The allocation driver
starts standbys in the background (``_slurm/standby.py``); when it needs a rank on their node it orders one
(``JobFiles.standby``: the step's rendezvous, counters and the rank, checked as an offer of exactly one rank), and
the standby takes that environment and runs the program as its ``__main__``, as ``python PROGRAM`` would -- the
same rank, the same restore. It touches no GPU while it waits (the device follows the rank it becomes: its CUDA
context is created then), no thread pool and no process group. It leaves on its own when the job's driver ended.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import time

from .._common import envvars as envvars
from .._common.jobfiles import OFFERED, JobFiles, Offer
from . import fastexit, ranklog
from .preload import modules

__all__ = ["main", "become", "POLL_S"]

POLL_S = 0.02  # how often a ready standby looks for its order (a stat of one file)
#: A driver silent this long is gone and no driver took its place (one that did kills this standby's step).
ABANDONED_S = 120.0


def _preload() -> None:
    """Import what every rank imports (a module that fails is said and skipped: the rank imports it itself)."""
    for name in modules():
        try:
            __import__(name)
        except BaseException as exc:  # noqa: BLE001 - a broken module must not take the standby down
            print(f"trainstack: standby: preloading {name!r} failed ({type(exc).__name__}: {exc})", file=sys.stderr,
                  flush=True)


def wait_for_order(folder: JobFiles, name: str) -> Offer | None:
    """The driver's order to this standby; None when the driver ended first, fell silent for good, or this process
    was orphaned."""
    while True:
        order = folder.standby.order_for(name)
        if order is not None:
            return order
        if folder.driver.has_ended() or os.getppid() == 1 or (folder.driver.silent_for() or 0) > ABANDONED_S:
            return None
        time.sleep(POLL_S)


def become(folder: JobFiles, name: str, order: Offer, torchrun: bool = False) -> int:
    """Take ``order``'s environment (its rendezvous and counters, nothing else; its rank through
    ``TRAINSTACK_TASK_RANKS``, or -- ``torchrun`` -- the variables torchrun gives its workers), tell the task's
    wrapper which rank and step this process now is; the rank."""
    rank = order.ranks[0]
    host = socket.gethostname()  # as the wrapper spells its records: $(hostname)
    folder.standby.note_rank(host, os.getppid(), rank)  # first: from here on a death is recorded as this rank's
    folder.step.note_step(host, os.getppid(), order.step)
    folder.standby.took(name)  # then at once: the driver starts the rank afresh where a standby stays silent
    for key in (*OFFERED, *_TORCHRUN_WORKER, "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)  # a value of the standby's start is not the step's
    os.environ.update(order.env)
    if torchrun:
        os.environ.update(torchrun_worker(rank, order.per_node, int(order.env.get(envvars.NPROCS, "0") or 0),
                                          order.step))
    else:
        os.environ[envvars.TASK_RANKS] = f"{order.per_node}/{rank}"  # this process is its step's only task
    ranklog.tee_rank_output(rank)  # the rank's log from its first line
    print(f"trainstack: standby {os.getpid()} on {fastexit.this_host()} is rank {rank} of job step {order.step}",
          file=sys.stderr, flush=True)
    return rank


#: What torchrun sets in each worker's environment (torch.distributed.elastic's agent), as a standby taking a
#: torchrun rank sets it: a program that reads them itself runs unchanged. Its rank 0 hosts the rendezvous store
#: (no agent store: TORCHELASTIC_USE_AGENT_STORE unset).
_TORCHRUN_WORKER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS")


def torchrun_worker(rank: int, per_node: int, world: int, step: int) -> dict[str, str]:
    """Torchrun's worker variables for ``rank`` of ``world`` ranks, ``per_node`` per node, in job step ``step``."""
    values = (rank, rank % per_node, world, per_node, rank // per_node, max(world // per_node, 1), rank, world,
              "default", f"{os.environ.get('SLURM_JOB_ID', 'standby')}.{step}", 0, 0)
    return {key: str(value) for key, value in zip(_TORCHRUN_WORKER, values, strict=True)}


def run_program(words: list[str]) -> None:
    """Run ``words`` (``script.py ARGS`` or ``-m module ARGS``) as this process's ``__main__``, as python would."""
    if words[:1] == ["-m"] and len(words) > 1:
        sys.argv = [words[1], *words[2:]]
        runpy.run_module(words[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(words[0])
    sys.argv = [words[0], *words[1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    torchrun = args[1:2] == ["--torchrun"]
    rest = args[2:] if torchrun else args[1:]
    if not args or len(rest) < 2 or rest[0] != "--":
        print("usage: python -m trainstack._runtime.standby NAME [--torchrun] -- PROGRAM [ARGS...] (started by "
              "trainstack's allocation driver)", file=sys.stderr)
        return 2
    name, program = args[0], rest[1:]
    folder = JobFiles.current()
    if folder is None:
        print(f"trainstack: standby {name}: no job folder ({envvars.JOB_DIR} unset): nothing to wait for",
              file=sys.stderr)
        return 2
    _preload()
    folder.standby.ready(name, fastexit.this_host(), os.getpid())
    order = wait_for_order(folder, name)
    if order is None:
        return 0
    become(folder, name, order, torchrun)
    run_program(program)
    return 0


if __name__ == "__main__":
    sys.exit(main())

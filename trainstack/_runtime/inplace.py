"""A rank whose peer died keeps its process: it waits for the allocation driver's next job step and joins that step's
process group in place, so only the crashed ranks start afresh (their Python, torch and CUDA start-up is the
relaunch; the survivors skip it). NVRx's in-process restart and torchft's stepping survivors are the models.

On by the driver for a ``--requeue`` job with one srun task per rank (``TRAINSTACK_IN_PLACE=1``; ``0`` in the job's
environment turns it off) where every shard of the model has a copy on another rank (DDP; HSDP over several replica
groups on gloo) and the backend can leave a failed group (``Accelerator.restarts_in_place``): a rank that lost a
peer closes its failed groups' connections (``groupsockets``: a peer blocked on it fails too), says it waits
(``peers-lost/``, marked ``waiting``), the driver decides as for any crash and, where the next step keeps this rank
at its place (the same nodes, a spare for a lost one, a shrink to the survivors), offers that step
(``rejoin/step-<n>.json``: its rendezvous, counters and sizes -- nothing else is taken from it, and only from a file
of this user's) before it starts only the missing ranks (``TRAINSTACK_TASK_RANKS``). The survivor then leaves the
failed group, takes the offer's environment (keeping its rank), joins the new group within ``JOIN_S`` (else it
leaves, saying where it could not join) and runs ``fit`` again, continuing from the state of its last complete
step (``_train/peers.py``) -- no step redone. No offer within ``WAIT_S`` (the driver requeued, stopped or relaunches
the whole step and kills it anyway), or one without this rank: the original error ends the process as before.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Protocol

from .._common import envvars as envvars
from .._common.jobfiles import OFFERED, JobFiles, Offer
from . import fastexit, groupsockets

__all__ = ["enabled", "may_wait", "in_place_step", "detach", "next_step", "join", "joined", "environment", "WAIT_S",
           "JOIN_S", "Rejoining"]


class Rejoining(Protocol):
    """What of the Accelerator this needs: its rank, and whether it can join a new group (``rejoin``)."""

    @property
    def rank(self) -> int: ...

    @property
    def restarts_in_place(self) -> bool: ...

    def rejoin(self, env: Mapping[str, str]) -> None: ...

WAIT_S = 120.0  # the driver decides in well under a second; it kills a step it does not continue in place
#: How long a rank continued in place may take to join the next step's group (the new ranks' start is most of it).
JOIN_S = 60.0


def enabled(accelerator: Rejoining) -> bool:
    """Does this rank restart in place after losing a peer: a job whose driver restarts in place, a model that can
    join a new group?"""
    return JobFiles.current() is not None and os.environ.get(envvars.IN_PLACE) == "1" and \
        accelerator.restarts_in_place


def may_wait(exc: BaseException, accelerator: Rejoining) -> bool:
    """Can this rank wait in place after ``exc`` ended its ``fit``: a lost peer, in a job whose driver restarts in
    place, with a model that can join a new group?"""
    return enabled(accelerator) and fastexit.secondary(type(exc), exc)


def in_place_step() -> bool:
    """Is this process in a job step that continues ranks in place (a survivor joined it, or it started beside
    survivors: ``TRAINSTACK_TASK_RANKS``)? Then every rank of the step takes the survivors' state (``peers``)."""
    return os.environ.get(envvars.IN_PLACE) == "1" and envvars.TASK_RANKS in os.environ


def detach(exc: BaseException) -> BaseException:
    """``exc`` with its traceback printed (the rank log says why this rank lost a peer) and then dropped, with those
    of its causes: their frames hold the failed run -- its wrapped model, whose process group keeps the connections
    to the other ranks open, and a rank blocked on this one would wait for the collective timeout."""
    traceback.print_exception(exc, file=sys.stderr)
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


def next_step(exc: BaseException, accelerator: Rejoining) -> Offer | None:
    """After ``exc`` (``detach``-ed) ended this rank's ``fit``, and the failed run was let go: the failed group's
    last references collected and its connections shut down (``groupsockets``: a rank blocked on this one fails
    too, also where torch's caches still hold the group -- a sharded model's mesh), then the driver's
    offer of the next job step where it continues this rank in place (it waits for the offer), else None. Only the
    driver's own offer counts (``JobFiles.rejoin_offer``: this user's file, checked)."""
    gc.collect()
    closed = groupsockets.shut()
    folder = JobFiles.current()
    assert folder is not None
    rank, step = accelerator.rank, int(os.environ.get(envvars.STEP, "0") or 0)
    folder.step.peer_lost(rank, fastexit.this_host(), step, waiting=True)
    print(f"trainstack: rank {rank} lost a peer in job step {step} ({type(exc).__name__}): its group's {closed} "
          f"connection(s) closed, waiting in place for the next step", file=sys.stderr, flush=True)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        offer = folder.step.offer_after(step)
        if offer is not None:
            if rank not in offer.ranks:
                return None
            folder.step.note_step(socket.gethostname(), os.getppid(), offer.step)
            print(f"trainstack: rank {rank} continues in place in job step {offer.step}", file=sys.stderr,
                  flush=True)
            return offer
        time.sleep(0.02)
    return None


def environment(offer: Offer, rank: int) -> dict[str, str]:
    """What this rank takes from ``offer``: its rendezvous and counters (``OFFERED`` only) and its own rank."""
    return {**{k: v for k, v in offer.env.items() if k in OFFERED},
            envvars.TASK_RANKS: keep_rank(rank, offer.per_node)}


_JOINING: list[tuple[int, Offer, threading.Timer]] = []  # the offer this process is joining, until its group forms


def join(accelerator: Rejoining, offer: Offer) -> None:
    """Take ``offer`` and join its step's process group -- now, or at the next distributed call -- within
    ``JOIN_S`` (``joined`` then tells the driver), or end this process with a line that says which step and
    rendezvous it could not join: a wrong or dead rendezvous never leaves it waiting silently."""
    rank = accelerator.rank

    def give_up() -> None:
        print(f"trainstack: rank {rank} could not join job step {offer.step} at {offer.where} within {JOIN_S:g} s: "
              f"leaving", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(JOIN_S, give_up)
    timer.daemon = True
    timer.start()
    _JOINING[:] = [(rank, offer, timer)]
    accelerator.rejoin(environment(offer, rank))


def joined() -> None:
    """This process's process group formed (``ProcessGroupSession.start``): a rank continued in place has joined
    its offered step -- the driver counts the step as started with it (``JobFiles.joined``)."""
    if not _JOINING:
        return
    (rank, offer, timer), = _JOINING
    _JOINING.clear()
    timer.cancel()
    folder = JobFiles.current()
    if folder is not None:
        folder.step.joined(rank, offer.step)


def keep_rank(rank: int, per_node: int) -> str:
    """``TRAINSTACK_TASK_RANKS`` for this process as a rank of the next step: its srun task (``SLURM_PROCID``, of the
    step that started it) is global rank ``rank`` of the next step's world (``TRAINSTACK_NPROCS``, also a smaller
    one after a shrink)."""
    task = int(os.environ.get("SLURM_PROCID", "0"))
    return f"{per_node}/{','.join(str(rank) if i == task else '-1' for i in range(task + 1))}"

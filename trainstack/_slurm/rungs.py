"""The recovery ladder, as data: each rung one class with the same small protocol, in one ordered tuple
(``LADDER``) that the driver climbs after the retry policy said "go" and that ``generate --explain`` prints.

A rung says what it does while a step fails (``holds``: keep the survivors' processes for the next step -- a restart
in place) and what it offers after (``offer``: a retry on which nodes, a requeue, or nothing: the next rung is
asked). Adding a rung is one class here, one entry in ``LADDER`` and its scenarios in ``tests/test_allocation.py``.
Torch-free, stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Rung", "Climb", "Retry", "Requeue", "InPlace", "SameOrSpare", "Shrink", "RequeueJob", "LADDER"]


@dataclass(frozen=True)
class Retry:
    """A new job step of this allocation, on ``nodes``."""

    nodes: list[str]


@dataclass(frozen=True)
class Requeue:
    """A new allocation: the job is requeued leaving ``exclude`` out."""

    kind: str
    exclude: list[str] = field(default_factory=list)


class Climb(Protocol):
    """What a rung reads of the allocation it offers for: the plan, the kind of end (``crash``, ``timeout``,
    ``preempt``), time enough left for a step, the usable hosts, why nodes are missing, the hosts a requeue leaves
    out; and how it says what it did."""

    @property
    def plan(self) -> Plan: ...

    @property
    def kind(self) -> str: ...

    def time_left(self) -> bool: ...

    def usable(self) -> list[str]: ...

    def missing(self) -> str: ...

    def excluded(self) -> list[str]: ...

    def say(self, line: str, error: bool = False) -> None: ...

    def event(self, kind: str, nodes: list[str], **fields: object) -> None: ...


class Rung(Protocol):
    """One way back from a failure."""

    name: str

    def applies(self, plan: Plan) -> bool:
        """Is this rung on in this plan?"""
        ...

    def holds(self) -> bool:
        """While a step fails: keep the waiting ranks' processes for the next step?"""
        ...

    def offer(self, climb: Climb) -> Retry | Requeue | None:
        """After the policy said go: what this rung offers (None: ask the next one)."""
        ...

    def explain(self, plan: Plan) -> str:
        """The rung in words, for ``generate --explain``."""
        ...


class InPlace:
    """The ranks that lost a peer keep their processes and join the next step: it starts only the missing ranks.
    It offers no step of its own -- it is how the next rung's step starts, where the ranks' places are kept."""

    name = "in place"

    def applies(self, plan: Plan) -> bool:
        return plan.recovery.requeue and plan.launch.task_log == "rank"

    def holds(self) -> bool:
        return True

    def offer(self, climb: Climb) -> Retry | Requeue | None:
        return None

    def explain(self, plan: Plan) -> str:
        return ("in place: with one task per rank, the ranks that lose a peer keep their processes (the Trainer, DDP "
                "on gloo); the failed step is kept and the next one starts only the missing ranks "
                "(TRAINSTACK_IN_PLACE=0 in the job's environment relaunches every rank)")


class SameOrSpare:
    """A crash is retried as a new step of this allocation on its usable nodes: the same ones, or a spare in the
    place of a lost or named one."""

    name = "same nodes or a spare"

    def applies(self, plan: Plan) -> bool:
        return plan.recovery.requeue

    def holds(self) -> bool:
        return False

    def offer(self, climb: Climb) -> Retry | Requeue | None:
        usable = climb.usable()
        if climb.kind != "crash" or not climb.time_left() or len(usable) < climb.plan.nodes:
            return None
        return Retry(usable[:climb.plan.nodes])

    def explain(self, plan: Plan) -> str:
        r = plan.recovery
        spare = f"{plan.spare_nodes} spare node(s) take the place of" if plan.spare_nodes else "no spare for"
        return (f"same nodes or a spare: a crash whose verdict is one of [{', '.join(r.retry_on)}] is retried as a "
                f"new step of this allocation (at most {r.max_retries} retries; the same cause without progress is "
                f"not), with at least {r.min_step_s} s left; {spare} a lost or named node")


class Shrink:
    """With no spare left, the step runs on the usable nodes when at least ``--min-nodes`` are (the trainer keeps
    the global batch: ``TRAINSTACK_PLANNED_WORLD``)."""

    name = "shrink"

    def applies(self, plan: Plan) -> bool:
        return plan.recovery.requeue and bool(plan.recovery.min_nodes)

    def holds(self) -> bool:
        return False

    def offer(self, climb: Climb) -> Retry | Requeue | None:
        low, usable = climb.plan.recovery.min_nodes or 0, climb.usable()[: climb.plan.nodes]
        if climb.kind != "crash" or not climb.time_left() or not low:
            return None
        return shrink_to(climb, usable, climb.missing())

    def explain(self, plan: Plan) -> str:
        return (f"shrink: with no spare left, the run continues on the surviving nodes (at least "
                f"{plan.recovery.min_nodes} of {plan.nodes}) at the exact sample, the global batch kept by gradient "
                f"accumulation")


def shrink_to(climb: Climb, usable: list[str], why: str) -> Retry | None:
    """The shrunk step on ``usable`` (said and recorded), or None when fewer than ``--min-nodes`` are left (said)."""
    low = climb.plan.recovery.min_nodes or 0
    if len(usable) < low:
        climb.say(f"only {len(usable)} usable node(s) left ({why}), fewer than --min-nodes {low}: the job is "
                  f"requeued", True)
        return None
    climb.say(f"no spare left ({why}): continuing on {len(usable)} of {climb.plan.nodes} nodes ({','.join(usable)}) "
              f"from the newest complete state, at its exact sample, without a requeue")
    climb.event("shrink", usable, planned=climb.plan.nodes, why=why)
    return Retry(usable)


class RequeueJob:
    """The last rung: the job is requeued leaving out the hosts blamed (also after a graceful stop)."""

    name = "requeue"

    def applies(self, plan: Plan) -> bool:
        return plan.recovery.requeue

    def holds(self) -> bool:
        return False

    def offer(self, climb: Climb) -> Retry | Requeue | None:
        return Requeue(climb.kind, climb.excluded())

    def explain(self, plan: Plan) -> str:
        r = plan.recovery
        return ("requeue: otherwise, or on a graceful stop (the time limit's warning, a preemption), the job is "
                "requeued leaving out the hosts blamed (scontrol requeue, ExcNodeList, StartTime=now)"
                + (f"; at most {r.max_requeues} requeues at the time limit" if r.max_requeues is not None else ""))


#: The ladder, in the order it is climbed.
LADDER: tuple[Rung, ...] = (InPlace(), SameOrSpare(), Shrink(), RequeueJob())

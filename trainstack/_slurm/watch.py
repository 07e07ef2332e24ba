"""One job step, watched: ``StepWatch.poll`` reads the step's processes and its records and returns what state the
step is in; the allocation driver's loop only dispatches on it (torch elastic's ``_invoke_run`` over a
``RunResult``). The states: ``Running``; ``Ended`` (every srun of the step returned); ``Held`` (every rank is out and
some wait in place: the step is kept for the next one); ``TearDown`` (the step failed and its grace is over: kill its
tasks); ``ForceKill`` (they did not end after that: kill the sruns). Which grace, and when a failure is known, is the
watch's own: a failing task's exit record, a rank that lost its peer, a survivor that never joined its offered step,
a host the probe found gone or presumed lost. Torch-free, stdlib only.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._common.jobfiles import JobFiles
from .inplace import Survivors
from .plan import Plan
from .slurmcmd import Slurm

__all__ = ["StepWatch", "Probe", "Running", "Ended", "Held", "TearDown", "ForceKill", "StepState", "GONE",
           "all_out", "presumed_lost"]

GONE = "a host of the step is gone"
PRESUME_LOST_S = 0.5  # ranks elsewhere lost a peer this long ago, a host's ranks silent: presumed lost (srun)
QUORUM_S = 0.3  # Slurm's probe heard every other host this long ago (and as long again as they took): not this one
FINISHED_GRACE_S = 5.0  # the run finished: an srun still waiting on a lost host's tasks is ended this much later


@dataclass(frozen=True)
class Running:
    """Nothing to do yet."""


@dataclass(frozen=True)
class Ended:
    """Every srun of the step returned: ``code`` is the step's status (srun's)."""

    code: int


@dataclass(frozen=True)
class Held:
    """Every rank is out and some wait in place: the step's sruns are kept for the next step; ``code`` is the first
    failing task's status (a lost node's: killed)."""

    code: int


@dataclass(frozen=True)
class TearDown:
    """The step failed and its grace is over: kill its tasks (``line`` says why)."""

    line: str


@dataclass(frozen=True)
class ForceKill:
    """The step's tasks did not end after ``TearDown``: kill its sruns."""


StepState = Running | Ended | Held | TearDown | ForceKill


class Probe:
    """Are a failed step's hosts still there? Asked in the background from the moment the failure is known, so the
    answer (a lost host's silence: 1.5 s after its peers answered, 5 s at most) overlaps the step's teardown; the
    answers so far are read before it ends (``silent_beside_answers``)."""

    def __init__(self, slurm: Slurm, hosts: list[str]) -> None:
        self.hosts, self.started = list(hosts), time.monotonic()
        self._answers: dict[str, bool] = {}  # filled by the thread as the hosts answer
        self._seen: dict[str, float] = {}  # when each answer was first read here
        self._thread = threading.Thread(target=lambda: slurm.answering(hosts, into=self._answers), daemon=True,
                                        name="trainstack-probe")
        self._thread.start()

    def answers(self) -> dict[str, bool]:
        self._thread.join()
        return {h: self._answers.get(h, False) for h in self.hosts}

    def gone(self) -> set[str]:
        """The hosts that did not answer, once the probe has ended (none before)."""
        return {h for h, ok in self.answers().items() if not ok} if self.done() else set()

    def found_lost(self) -> bool:
        """Has the probe ended with a host that did not answer? (Without waiting for it.)"""
        return self.done() and not all(self.answers().values())

    def silent_beside_answers(self, now: float) -> set[str]:
        """Slurm's evidence before the probe's settle window is out: the hosts that have not answered while every
        other one answered, since at least as long again as the slowest of those took (``QUORUM_S`` at least)."""
        answers = dict(self._answers)
        for host in answers:
            self._seen.setdefault(host, now)
        silent = set(self.hosts) - set(answers)
        if not silent or not answers or not all(answers.values()):
            return set()
        last = max(self._seen.values())
        return silent if now - last >= max(QUORUM_S, last - self.started) else set()

    def done(self) -> bool:
        return not self._thread.is_alive()


class StepWatch:
    """The watch over job step ``step`` on ``nodes``: its sruns (``procs``; ``new`` the one this step started, None
    when it continues every rank in place), its records, its probe. ``detected`` is called once, at the step's first
    failure (the timeline's event); ``continues_without`` says whether the run can go on without hosts presumed lost
    (a spare takes their place, or -- Slurm's probe confirming them silent -- the survivors shrink)."""

    def __init__(self, files: JobFiles, plan: Plan, slurm: Slurm, in_place: Survivors, step: int, nodes: list[str],
                 new: subprocess.Popen[bytes] | None, procs: list[subprocess.Popen[bytes]], kill_after_s: float,
                 detected: Callable[[], None], continues_without: Callable[[list[str], bool], bool]) -> None:
        self.files, self.plan, self.slurm, self.in_place = files, plan, slurm, in_place
        self.step, self.nodes, self.new, self.procs = step, nodes, new, procs
        self.kill_after_s, self._on_detected, self._continues_without = kill_after_s, detected, continues_without
        self.base = plan.recovery.teardown_grace_s
        self.world = len(nodes) * plan.procs_per_node
        self.probe: Probe | None = None  # the step's hosts, asked since its failure
        self.presumed: list[str] = []  # hosts presumed lost before the probe's answer
        self.detected, self.why = False, ""
        self.failed_at: float | None = None
        self.kill_at: float | None = None
        self.started, self.looked = time.time(), 0.0
        self.finished_at: float | None = None  # the run finished while sruns of an earlier step still ran

    def poll(self, now: float) -> StepState:
        """The step's state now (``now``: ``time.monotonic()``)."""
        if all(p.poll() is not None for p in self.procs):
            # a step that started no srun of its own (a shrink, ranks in standbys): its first failing task's status
            code = self.new.returncode if self.new is not None else \
                next((x.code for x in self.files.step.exits(self.step)), 0)
            if code != 0 or self.files.step.has_exits(self.step):
                self._detect()
            return Ended(code)
        if self._finished_beside_a_lost_host(now):
            return ForceKill()
        self._notice(now)
        grace = self.grace()
        gone = self.gone_ranks() if self.why == GONE else set()
        if self.failed_at is not None and self.kill_at is None:
            # who is out is read before who waits: a survivor's mark written between the two reads is seen by the
            # second (read the other way round, it was out but not waiting, and its step was torn down)
            out = self.failed_at > now - grace and all_out(self.files, self.step, self.nodes, self.plan, gone)
            if self.in_place.all_waiting(self.step, self.world, gone):
                return Held(next((x.code for x in self.files.step.exits(self.step)), 137))
            if out:
                self.failed_at, self.why = now - grace, "every rank of the step has left or lost a peer"
        if self.failed_at is not None and self.kill_at is None and self.plan.recovery.requeue and \
                now - self.failed_at >= grace:
            self.kill_at = now + self.kill_after_s  # srun itself, if Slurm's kill did not end it
            return TearDown(f"{self.why.format(grace)}: killing its tasks")
        return ForceKill() if self.kill_at is not None and now >= self.kill_at else Running()

    def _finished_beside_a_lost_host(self, now: float) -> bool:
        """The run finished (the trainer's ``finished`` event, in this step) and only sruns carried from an earlier
        step still run -- srun waits for the tasks of a lost host until Slurm declares it dead (SlurmdTimeout): past
        ``FINISHED_GRACE_S`` they are ended, so the job ends with its training."""
        if self.failed_at is not None or (self.new is not None and self.new.poll() != 0) or \
                not all(p.poll() is not None or p in self.in_place.carried_procs for p in self.procs):
            return False
        if self.finished_at is None and now - self.looked >= 1.0:
            self.looked = now
            if any(e.get("kind") == "finished" and float(e.get("time", 0)) >= self.started
                   for e in self.files.events()[-20:]):
                self.finished_at = now
        return self.finished_at is not None and now - self.finished_at >= FINISHED_GRACE_S

    def grace(self) -> float:
        """How long the failed step may take to end before it is killed (with restarts in place: the survivors'
        time to say they wait)."""
        return self.in_place.grace(self.step, self.base) if self.failed_at is not None else self.base

    def _notice(self, now: float) -> None:
        """What is known of the step's failure now: an exit record, a lost peer, a survivor that never joined, a host
        gone or presumed lost."""
        exited = self.files.step.has_exits(self.step)
        if exited or self.files.step.peers_lost(self.step):
            self._detect()  # a rank that lost a peer says so before it leaves (fastexit): a lost node's sign
        if self.failed_at is None and exited:
            self.failed_at, self.why = now, "the step did not end {:g} s after its first failure"
        late = self.in_place.late(self.step) if self.failed_at is None else []
        if late:  # a survivor that took the offer but never joined: the step did not start
            self.failed_at, self.why = now - self.base, (f"rank(s) {', '.join(map(str, late))} did not join job "
                                                         f"step {self.step} within {self.in_place.join_s:g} s of "
                                                         f"its offer")
        grace = self.grace()
        if (self.failed_at is None or self.failed_at > now - grace) and self.why != GONE and \
                self.probe is not None and (self.probe.found_lost() or (self.detected and self._presume_lost(now))):
            # the others may wait in place; without that the step is torn down at once
            self.failed_at = (self.failed_at or now) if self.in_place.enabled else now - grace
            self.why = GONE

    def _detect(self) -> None:
        """The step's first failure: recorded, and its hosts probed at once, while the step is torn down."""
        if self.detected:
            return
        self.detected = True
        self._on_detected()
        if self.plan.recovery.requeue:
            self.probe = Probe(self.slurm, self.nodes)

    def _presume_lost(self, now: float) -> bool:
        """A lost node's mark seen before the probe's answer is in (``presumed_lost``), where the run goes on without
        it: a spare takes its place, or, Slurm's probe having heard every other host but not it
        (``Probe.silent_beside_answers``), the survivors shrink. The step is killed (or held) at once and the next
        one launched while the probe still asks; a requeue waits for the probe."""
        silent = presumed_lost(self.files, self.step, self.nodes) if self.plan.launch.task_log == "rank" else []
        confirmed = self.probe is not None and set(silent) <= self.probe.silent_beside_answers(now)
        if not silent or not self._continues_without(silent, confirmed):
            return False
        self.presumed = silent
        return True

    def gone_ranks(self) -> set[int]:
        """The ranks of the step on hosts presumed lost or found gone by the probe (so far)."""
        per, hosts = self.plan.procs_per_node, set(self.presumed) | (self.probe.gone() if self.probe else set())
        return {r for r in range(self.world) if self.nodes[r // per] in hosts}


def all_out(files: JobFiles, step: int, nodes: list[str], plan: Plan, gone: set[int]) -> bool:
    """Every rank of job step ``step`` recorded its exit (one srun task each) or its node's task did (torchrun,
    spawn), said it lost a peer (it sleeps before it leaves) or went with its host (``gone``): the step's teardown
    grace has nothing left to wait for."""
    per = plan.procs_per_node
    if plan.launch.task_log == "rank":
        return len(files.step.accounted(step) | gone) >= len(nodes) * per
    out = files.step.hosts_out(step, per) | {nodes[r // per] for r in gone}
    return all(host in out for host in nodes)


def presumed_lost(files: JobFiles, step: int, nodes: list[str]) -> list[str]:
    """The hosts of job step ``step`` presumed lost before the probe's answer (1.5-5 s) -- with one srun task per
    rank, whose wrapper records its exit at once: ranks on other hosts lost a peer ``PRESUME_LOST_S`` ago, no task
    recorded an exit, and no rank of these hosts said a thing (their tasks died with them). [] when none is."""
    if files.step.has_exits(step):
        return []
    signs = files.step.peer_hosts(step)
    if not signs or time.time() - min(signs.values()) < PRESUME_LOST_S:
        return []
    return [h for h in nodes if h not in signs]

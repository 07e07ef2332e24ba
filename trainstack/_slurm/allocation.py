"""``python -m trainstack._slurm.allocation SCRIPT < PLAN``: the driver of one job's allocation, which the job
script execs on its batch host with the script's plan (``plan.py``) on standard input.

It owns what runs next, as a typed loop shaped like torch elastic's agent (``SimpleElasticAgent._invoke_run``):
choose the nodes of the next job step from the pool (spares take the place of lost or named nodes), check them
(``preflight``), launch the step and dispatch on its state as its watch returns it (``watch.StepWatch``: running,
ended, held for a restart in place, torn down), then ``decide``: the one retry policy (``attempt.py``) says whether
to go on, and the recovery ladder (``rungs.LADDER``: in place, the same nodes or a spare, shrink, requeue -- each a
class) says how: ``Finish``, ``Retry`` on other nodes of this allocation, ``Requeue`` leaving the blamed hosts out,
or ``Stop``. Signals are handlers that ask the trainer to checkpoint (the stop file); the Slurm commands are
``slurmcmd.Slurm``'s; the job folder's files are ``JobFiles``'. Torch-free, stdlib only: the batch host needs a
Python 3.10+ and this package (``trainstack submit`` ships it in the job folder for a host that has none).
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from .._common import envvars as envvars
from .._common.jobfiles import JobFiles
from . import attempt as policy
from . import sentinel, standby
from .batchjob import BatchJob
from .handback import HandBack
from .inplace import Survivors
from .keeper import Keeper, next_step
from .plan import Plan
from .preflight import Preflight
from .rungs import LADDER, Requeue, Retry
from .slurmcmd import Slurm
from .standby import Standbys
from .stepcmd import StepCommand
from .watch import Ended, ForceKill, Held, Probe, StepWatch, TearDown

__all__ = ["Allocation", "NodePool", "Finish", "Retry", "Requeue", "Stop", "main"]

SENTINEL = sentinel.STEP_NAME


class NodePool:
    """The allocation's hosts in order, less those lost (no answer) and those left out (blamed, named)."""

    def __init__(self, allocated: list[str]) -> None:
        self.allocated = list(allocated)
        self.lost: list[str] = []
        self.left_out: list[str] = []

    def usable(self) -> list[str]:
        return [h for h in self.allocated if h not in self.lost and h not in self.left_out]

    def choose(self, count: int) -> list[str] | None:
        """The first ``count`` usable hosts, or None when fewer are left."""
        usable = self.usable()
        return usable[:count] if len(usable) >= count else None

    def lose(self, hosts: list[str]) -> None:
        self.lost += [h for h in hosts if h not in self.lost]

    def leave_out(self, hosts: list[str]) -> None:
        self.left_out += [h for h in hosts if h not in self.left_out]

    def readmit(self, hosts: list[str]) -> None:
        self.left_out = [h for h in self.left_out if h not in hosts]

    def recover(self, hosts: list[str]) -> None:
        """Hosts presumed lost that answered after all: usable again."""
        self.lost = [h for h in self.lost if h not in hosts]


@dataclass(frozen=True)
class Finish:
    """The run finished: the job ends with status 0."""


@dataclass(frozen=True)
class Stop:
    """The job ends with ``status`` (no retry, no requeue)."""

    status: int


Decision = Finish | Retry | Requeue | Stop


@dataclass(frozen=True)
class StepEnd:
    """How a job step ended: the first failing task's status (srun's own when no task recorded one), and the
    trainer's answers to a stop request."""

    status: int
    saved: bool = False
    finished: bool = False


class Allocation:
    """The loop of one job's allocation. ``slurm`` is every Slurm command it runs; ``env`` the job's environment."""

    def __init__(self, plan: Plan, slurm: Slurm, env: Mapping[str, str], script: Path | None = None,
                 poll_s: float = 0.1, kill_after_s: float = 0.3,
                 emit: Callable[[str, bool], None] | None = None, takeover: int = 0,
                 lost_host: str | None = None) -> None:
        self.plan, self.slurm, self.takeover = plan, slurm, takeover  # takeover: a driver after a dead one
        self.lost_host = lost_host  # a sentinel's driver: the batch host it took for lost
        self.poll_s, self.kill_after_s = poll_s, kill_after_s
        self.job = BatchJob(plan, slurm, env, script, emit or _emit)
        self.files = self.job.files
        self.pool = NodePool([])
        self.step = 0
        self.stop_kind: str | None = None
        self.preflight = Preflight(self)
        self.sentinel_host: str | None = None  # where the sentinel watches the batch host from
        self.held = HandBack(slurm, self.job)  # the hosts it holds: a lost one handed back once unused
        self.watch: StepWatch | None = None  # the last step's watch: its probe, its hosts presumed lost
        self.pending: tuple[StepWatch, list[str]] | None = None  # the probe's answer on those, awaited beside the next
        self.log: Path | None = None
        holds = any(rung.holds() and rung.applies(plan) for rung in LADDER)  # a rung keeps the survivors
        self.in_place = Survivors(self.files, slurm, self.kept_steps, holds and Survivors.wanted(env, self.job.warn))
        self.command = StepCommand(plan, self.job, self.in_place, slurm.job_id)  # what each step runs
        count = standby.wanted(env, self.job.warn) if plan.standbys else 0
        count = plan.standbys if count is None else count
        self.standbys = Standbys(self.files, lambda host, name: slurm.launch(*self.command.standby(host, name),
                                                                             self.job.cwd),
                                 count, plan.procs_per_node, self.job.emit,
                                 lambda kind, hosts, **fields: self.job.event(kind, hosts, self.step, **fields))

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run the job to its end; the job's exit status."""
        status = 1
        try:
            self._begin()
            status = self._loop()
        except SystemExit as exc:  # a job that cannot start, or SIGTERM without a graceful stop (recorded: 143)
            status = int(exc.code) if isinstance(exc.code, int) else 1
        finally:
            self.in_place.release()
            self.standbys.stop()
            self.held.lost(self.pool.lost, self.step, wait=True)  # its end must not wait for a lost node
            self.job.end(status, self.step, self.pool.lost)
        return status

    def _loop(self) -> int:
        nodes = self._first_nodes()
        if isinstance(nodes, Requeue):
            return self.job.requeue(nodes, 1, self.step)
        while True:
            if nodes is None:
                self.job.warn(f"fewer than {self.plan.nodes} usable node(s) in this allocation ({self.missing_why()})")
                return 1
            self.job.event("step_start", nodes, self.step)
            checked = self.preflight.before(nodes) if self.plan.node_check else nodes
            if isinstance(checked, Requeue):
                return self.job.requeue(checked, 0, self.step)
            nodes = checked
            ended = self.run_step(nodes)
            decision = self.decide(ended, nodes)
            if not isinstance(decision, Retry):
                self.in_place.release()
            if isinstance(decision, Finish):
                return self.job.finished(self.step)
            if isinstance(decision, Stop):
                return decision.status
            if isinstance(decision, Requeue):
                return self.job.requeue(decision, ended.status, self.step)
            self.job.report(self.step)
            self.step += 1
            nodes = decision.nodes
            self.job.say(f"crash (exit status {ended.status}): retrying in this allocation as step {self.step} on "
                         f"{','.join(nodes)} (no requeue)")

    def _first_nodes(self) -> list[str] | Requeue | None:
        """The first step's nodes: the planned count, else -- short of nodes from the start (a sentinel's driver
        without the lost batch host, a requeue that started on fewer) -- what the ladder offers."""
        nodes = self.pool.choose(self.plan.nodes)
        if nodes is not None or not (self.lost_host or self.plan.recovery.min_nodes):
            return nodes
        first = self.ladder(self.climb("crash", [self.lost_host] if self.lost_host else []))
        return first.nodes if isinstance(first, Retry) else first if self.lost_host else None

    # ------------------------------------------------------------------ one step
    def run_step(self, nodes: list[str]) -> StepEnd:
        """Launch the step on ``nodes`` and dispatch on its state until it ends (``watch.StepWatch``): its tasks are
        killed when its watch says the failed step's grace is over, its sruns kept when its ranks wait in place."""
        self.files.step.clear()
        if self.step:
            self.files.mark_started()
            self.files.mark_attempt_in_logs(f"{self.job.restart}.{self.step}")
        if self.step or self.job.restart:
            self.job.event("relaunch", nodes, self.step)
        new, procs = self._launch(nodes)
        if not self.in_place.carried_any:  # no surviving srun spans a lost node now: it can be handed back
            self.held.lost(self.pool.lost, self.step)
        watch = self.watch = StepWatch(self.files, self.plan, self.slurm, self.in_place, self.step, nodes, new, procs,
                                       self.kill_after_s, lambda: self.job.event("detected", nodes, self.step),
                                       self._continues_without)
        while True:
            self._reconcile()
            self.standbys.tend(self.pool.usable(), nodes, time.monotonic())
            state = watch.poll(time.monotonic())
            if isinstance(state, (Ended, Held)):
                code = state.code
                break
            if isinstance(state, TearDown):
                self.job.warn(state.line)
                self.slurm.kill_steps(keep=self.kept_steps())
            elif isinstance(state, ForceKill):
                for p in procs:
                    p.kill()
            time.sleep(self.poll_s)
        if isinstance(state, Held):
            self.in_place.hold(procs, self.step)  # not killed: the next step continues its waiting ranks
        self.job.event("step_end", nodes, self.step)
        self.files.seal_logs()
        saved, finished = self.files.stop.answers()
        self.files.stop.clear()
        return StepEnd(first_failure(self.files, self.step, code if code >= 0 else 128 - code, self.job.warn),
                       saved, finished)

    def _launch(self, nodes: list[str]) -> tuple[subprocess.Popen[bytes] | None, list[subprocess.Popen[bytes]]]:
        """The step's new srun (None: a shrink continues every rank in place, or warm standbys took the ranks it
        starts) and all its sruns (held ones, standbys' too)."""
        beside = self.in_place.missing(nodes, self.plan.procs_per_node)
        env = self.command.env(nodes, self.step, beside)
        self.standbys.step_started(time.monotonic())
        per, carried = self.plan.procs_per_node, []
        if beside is None:  # every rank starts: in standbys after a failed step, where enough are ready
            self.in_place.release()
            placement = {host: list(range(i * per, (i + 1) * per)) for i, host in enumerate(nodes)} if self.step else {}
        else:
            self.in_place.offer(self.step, env, per)
            started = f"; starting rank(s) {', '.join(map(str, beside[1]))} on {beside[0]}" if beside[1] else ""
            self.job.say(f"rank(s) {', '.join(map(str, sorted(self.in_place.waiting)))} continue in place{started}")
            placement, carried = ({beside[0]: beside[1]} if beside[1] else {}), self.in_place.carried()
        warm = self.standbys.start(placement, self.step, env, per, len(nodes) * per, lambda some: self.slurm.launch(
            self.command.argv(nodes, some), self.command.env(nodes, self.step, some), self.job.cwd))
        new = None if warm is not None or (beside is not None and not beside[1]) else \
            self.slurm.launch(self.command.argv(nodes, beside), env, self.job.cwd)
        return new, [*([new] if new is not None else []), *(warm or []), *carried]

    def kept_steps(self) -> set[str]:
        """The job steps a failed step's teardown never kills: the sentinel's, the idle standbys'."""
        return {SENTINEL, *self.standbys.names()}

    def _continues_without(self, hosts: list[str], confirmed: bool) -> bool:
        """Can the run go on without ``hosts`` (presumed lost)? A spare takes their place; or, where Slurm's probe
        heard every other host but not these (``confirmed``), the survivors are at least ``--min-nodes``. Then the
        step ends at once and the next one is launched while the probe still asks (a host that answers after all is
        usable again, ``_reconcile``)."""
        left, low = len([h for h in self.pool.usable() if h not in hosts]), self.plan.recovery.min_nodes
        if left < self.plan.nodes and not (confirmed and low and left >= low):
            return False
        self.job.event("presumed_lost", hosts, self.step)
        return True

    def _reconcile(self) -> None:
        """The probe's answer on hosts presumed lost, once it is in (never waited for): one that answered after all
        is usable again -- a spare for a later failure."""
        if self.pending is None or (self.pending[0].probe is not None and not self.pending[0].probe.done()):
            return
        (watch, hosts), self.pending = self.pending, None
        back = [h for h, ok in watch.probe.answers().items() if ok and h in hosts] if watch.probe else []
        if back:
            self.pool.recover(back)
            self.job.say(f"{','.join(back)} answered Slurm after all (presumed lost when its ranks fell silent): "
                         f"usable again, as a spare")
            self.job.event("answered", back, self.step)

    # ------------------------------------------------------------------ what comes next
    def decide(self, ended: StepEnd, nodes: list[str]) -> Decision:
        """What follows a step's end, through the one retry policy; every decision is said and recorded."""
        r, folder = self.plan.recovery, self.files.folder
        final = self._without_ladder(ended)
        if final is not None:
            return final
        kind = (self.stop_kind or "timeout") if ended.saved else "crash"
        if ended.finished and self.stop_kind and not ended.saved:  # the signal came after the run ended
            kind = self.stop_kind
        where = self.context(nodes)
        if kind == "crash":
            self._probe(nodes)
            outcome = policy.decide(folder, ended.status, tuple(r.retry_on), r.max_retries, where, self.log)
        else:
            outcome = policy.stopped(folder, ended.status, kind, r.max_requeues, where)
        self.job.warn(outcome.line)
        if not outcome.go:
            return Stop(ended.status or 1)
        if outcome.blamed:
            self.pool.leave_out([outcome.blamed])
        decision = self.ladder(self.climb(kind, outcome.exclude))
        if isinstance(decision, Requeue) and outcome.note:
            self.job.warn(outcome.note)
        if isinstance(decision, Requeue) and kind == "crash" and self.pool.left_out:  # never starved silently
            self.job.warn(f"no spare left in this allocation ({self.missing_why()}): the job is requeued")
        return decision

    def _without_ladder(self, ended: StepEnd) -> Decision | None:
        """The ends no rung is asked about: success, a job without --requeue, a cancelled one."""
        if ended.status == 0 and not ended.saved:
            return Finish()
        if not self.plan.recovery.requeue:
            if ended.saved:
                self.job.say(f"stopped gracefully with a complete checkpoint ({self.stop_kind or 'timeout'}); not "
                             f"requeued (no --requeue): resubmit with resume='auto' to continue")
                return Stop(0)
            return Stop(ended.status)
        if self.files.cancelled():
            self.job.warn("cancelled (trainstack cancel): not requeueing")
            return Stop(ended.status or 1)
        return None

    def ladder(self, climb: Climbing) -> Retry | Requeue:
        """The first rung's offer, climbing ``LADDER`` in order (the last rung always offers)."""
        return next(d for rung in LADDER if rung.applies(self.plan) and (d := rung.offer(climb)) is not None)

    def climb(self, kind: str, exclude: list[str] | None = None) -> Climbing:
        """The allocation as the ladder's rungs read it, for an end of ``kind``."""
        return Climbing(self, kind, list(exclude or []))

    def missing_why(self) -> str:
        """Why nodes are missing from the pool (lost, left out), in words."""
        lost, out = ",".join(self.pool.lost), ",".join(h for h in self.pool.left_out if h not in self.pool.lost)
        short = len(self.pool.allocated) < self.plan.allocated_nodes
        return "; ".join(p for p in (f"{lost} lost" if lost else "", f"{out} left out" if out else "",
                                     f"the allocation has {len(self.pool.allocated)} of {self.plan.allocated_nodes} "
                                     f"nodes" if short else "") if p) or "a node is missing"

    def _probe(self, nodes: list[str]) -> None:
        """Every host of a failed step asked (a trivial step; started at the failure, see ``Probe``):
        one that does not answer is lost, named in ``lost`` with the ranks it ran."""
        per, watch = self.plan.procs_per_node, self.watch
        if watch is not None and watch.presumed and watch.probe is not None:  # the next step does not wait for
            self.pending = (watch, list(watch.presumed))                       # Slurm's answer on them
            answers = {h: h not in watch.presumed for h in nodes}
        else:
            answers = (watch.probe if watch is not None and watch.probe else Probe(self.slurm, nodes)).answers()
        lost = {h: list(range(i * per, i * per + per)) for i, h in enumerate(nodes) if not answers.get(h)}
        if lost:
            self.files.step.write_lost(lost)
            self.pool.lose(list(lost))
            if self.sentinel_host in lost:  # its node went: the batch host is watched from another one
                self.job.say(f"the sentinel's node {self.sentinel_host} is lost: watching the batch host from "
                             f"another node")
                self.watch_batch_host(self.pool.usable())

    def context(self, nodes: list[str]) -> policy.Context:
        """The attempt being decided, for the policy."""
        return policy.Context(self.job.restart, self.step, list(nodes), self.plan.procs_per_node, self.need(),
                              self.slurm.partition_nodes())

    def need(self) -> int:
        """The nodes a requeued attempt needs: ``--min-nodes`` where set (it may start on fewer than it asks)."""
        return self.plan.recovery.min_nodes or int(self.job.env.get("SLURM_NNODES") or self.plan.allocated_nodes)

    # ------------------------------------------------------------------ the job's start and end
    def _begin(self) -> None:
        """The job's record and environment, the pool of its hosts, the signals, the sentinel, the versions."""
        self.pool = NodePool(self.job.begin(self.takeover))
        self.files.standby.clear()  # the standbys of an earlier attempt or driver are gone (their steps killed)
        self.held.hold([h for h in self.pool.allocated if h != self.lost_host])
        self.log = self.slurm.log_path()  # the job's own log: what torchrun's agents said of their workers
        if self.takeover:  # the dead driver's steps, lost and blamed hosts are this one's to go on from
            self.step = next_step(self.files)
            self.pool.lose([host for host, _ in self.files.step.lost()])
            self.pool.leave_out([str(r["blamed"]) for r in policy.history(self.files.folder)
                                 if r.get("blamed") and r.get("attempt") == self.job.restart])
            self.preflight.checked.update(self.pool.usable())  # checked by the driver before it
            self.pool.lose([self.lost_host] if self.lost_host else [])  # a sentinel's driver: the lost batch host
        if self.plan.recovery.graceful_stop:
            signal.signal(signal.SIGUSR1, lambda *_: self._stop("timeout", "SIGUSR1"))
            signal.signal(signal.SIGUSR2, lambda *_: self._stop("timeout", "SIGUSR2"))
            signal.signal(signal.SIGTERM, lambda *_: self._stop("preempt", "SIGTERM"))
        else:
            signal.signal(signal.SIGTERM, _terminated)
        if self.plan.recovery.requeue and (not self.takeover or self.lost_host):  # a keeper's driver: the first
            self.watch_batch_host(self.pool.usable())                             # one's sentinel watches on
        if not self.takeover or (self.plan.launch.torchrun and self.plan.recovery.graceful_stop):  # said once:
            self.job.provenance(f"{(self.pool.choose(1) or ['?'])[0]}:{self.command.port(self.step)}")  # be quick

    def watch_batch_host(self, hosts: list[str]) -> None:
        """The sentinel, on the first of ``hosts`` that is not the batch host (again after its node was lost: its
        duty survives the loss of any one node)."""
        self.sentinel_host = sentinel.start(self.slurm, self.files, hosts, self.job.env, self.job.requeue_id,
                                            self.need(), self.job.restart)

    def _stop(self, kind: str, name: str) -> None:
        self.stop_kind = kind
        why = " (a preemption, or a plain scancel: Slurm sends both the same signal; trainstack cancel ends a job " \
              "without a requeue)" if kind == "preempt" and self.plan.recovery.requeue else ""
        self.job.say(f"{name} at {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}: asking the "
                     f"trainer to checkpoint and stop{why}")
        self.files.stop.request()


@dataclass
class Climbing:
    """What the ladder's rungs read of this allocation as they offer (``rungs.Climb``)."""

    alloc: Allocation
    kind: str
    exclude: list[str]

    @property
    def plan(self) -> Plan:
        return self.alloc.plan

    def time_left(self) -> bool:
        left = self.alloc.slurm.seconds_left()
        return left is None or left >= self.plan.recovery.min_step_s

    def usable(self) -> list[str]:
        return self.alloc.pool.usable()

    def missing(self) -> str:
        return self.alloc.missing_why()

    def excluded(self) -> list[str]:
        return list(self.exclude)

    def say(self, line: str, error: bool = False) -> None:
        (self.alloc.job.warn if error else self.alloc.job.say)(line)

    def event(self, kind: str, nodes: list[str], **fields: object) -> None:
        self.alloc.job.event(kind, nodes, self.alloc.step, **fields)


def first_failure(files: JobFiles, step: int, status: int, warn: Callable[[str], None]) -> int:
    """A failed step's status: its first failing task's. srun returns the largest status of its tasks, which after
    one failed is the SIGTERM (143) that --kill-on-bad-exit sent the others (said when they differ)."""
    exits = files.step.exits(step)
    if status == 0 or not exits:
        return status
    first = exits[0]
    if first.code != status:
        at = datetime.datetime.fromtimestamp(first.time).strftime("%H:%M:%S")
        warn(f"{first.unit.replace('-', ' ', 1)} on {first.host} failed first (exit status {first.code} at {at}); "
             f"srun's {status} is the stop of the others")
    return first.code


def _emit(line: str, error: bool) -> None:
    """A line of the job's log (stderr for what went wrong, as the batch shell wrote it)."""
    print(f"trainstack: {line}", file=sys.stderr if error else sys.stdout, flush=True)


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM to a job without a graceful stop (scancel, the time limit): the job's record says 143, never a
    success. Once: Slurm signals the batch script's process group and the keeper forwards it too, and a second
    SystemExit would cut the job's end short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = sys.stdin.read()
    devnull = os.open(os.devnull, os.O_RDONLY)  # the steps do not inherit the plan's heredoc
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        plan = Plan.from_json(text)
    except ValueError as exc:
        print(f"trainstack: the job's plan cannot be read: {exc}", file=sys.stderr)
        return 1
    if other := plan.other_source():
        _emit(other, True)
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("trainstack: the allocation driver runs inside a Slurm job (no SLURM_JOB_ID): submit the script "
              "with sbatch", file=sys.stderr)
        return 1
    slurm, script = Slurm(job), Path(args[0]) if args else None
    where = BatchJob(plan, slurm, os.environ, script, _emit)  # the job folder and its requeue id: nothing started
    keeper = Keeper(where.files, lambda takeover: Allocation(plan, slurm, os.environ, script, takeover=takeover).run(),
                    lambda: slurm.kill_steps(keep=SENTINEL),
                    lambda: plan.recovery.requeue and slurm.requeue(where.requeue_id).done, _emit)
    return keeper.run()


if __name__ == "__main__":
    sys.exit(main())

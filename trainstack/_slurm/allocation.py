"""``python -m trainstack._slurm.allocation SCRIPT < PLAN``: the driver of one job's allocation, which the job
script execs on its batch host with the script's plan (``plan.py``) on standard input.

It owns what runs next, as a typed loop shaped like torch elastic's agent (``SimpleElasticAgent._invoke_run``):
choose the nodes of the next job step from the pool (spares take the place of lost or named nodes), check them
(``preflight``), launch the step and wait for it (a failed step's remains are killed a few seconds after its first
failure), then ``decide`` -- ``Finish``, ``Retry`` on other nodes of this allocation, ``Requeue`` leaving the blamed
hosts out, or ``Stop`` -- through the one retry policy (``attempt.py``). Signals are handlers that ask the trainer
to checkpoint (the stop file); the Slurm commands are ``slurmcmd.Slurm``'s; the job folder's files are
``JobFiles``'. Torch-free, stdlib only: the batch host needs a Python 3.10+ and this package (``trainstack submit``
ships it in the job folder for a host that has none).
"""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from .. import _envvars as envvars
from .._jobfiles import EXIT_RECORD_SH, JobFiles
from . import attempt as policy
from . import sentinel
from .batchjob import BatchJob
from .inplace import Survivors
from .nodecheck import check as judge_nodes
from .nodecheck import describe as describe_check
from .nodecheck import measure as measure_nodes
from .plan import Plan
from .slurmcmd import Slurm

__all__ = ["Allocation", "NodePool", "Finish", "Retry", "Requeue", "Stop", "main"]

#: torchrun >= 2.9 forwards these to its workers; older ones stop on them (the stop then comes through the driver).
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
SENTINEL = sentinel.STEP_NAME
GONE = "a host of the step is gone"
PRESUME_LOST_S = 0.5  # ranks elsewhere lost a peer this long ago, a host's ranks silent: presumed lost (srun)


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


class Probe:
    """Are a failed step's hosts still there? Asked in the background from the moment the failure is known, so the
    answer (a lost host's silence: 1.5 s after its peers answered, 5 s at most) overlaps the step's teardown."""

    def __init__(self, slurm: Slurm, hosts: list[str]) -> None:
        self._answers: dict[str, bool] = {}
        self._thread = threading.Thread(target=lambda: self._answers.update(slurm.answering(hosts)), daemon=True,
                                        name="trainstack-probe")
        self._thread.start()

    def answers(self) -> dict[str, bool]:
        self._thread.join()
        return dict(self._answers)

    def gone(self) -> set[str]:
        """The hosts that did not answer, once the probe has ended (none before)."""
        return {h for h, ok in self._answers.items() if not ok} if self.done() else set()

    def found_lost(self) -> bool:
        """Has the probe ended with a host that did not answer? (Without waiting for it.)"""
        return self.done() and not all(self._answers.values())

    def done(self) -> bool:
        return not self._thread.is_alive()


@dataclass(frozen=True)
class Finish:
    """The run finished: the job ends with status 0."""


@dataclass(frozen=True)
class Retry:
    """A new job step of this allocation, on ``nodes``."""

    nodes: list[str]


@dataclass(frozen=True)
class Requeue:
    """A new allocation: the job is requeued leaving ``exclude`` out."""

    kind: str
    exclude: list[str] = field(default_factory=list)


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
                 emit: Callable[[str, bool], None] | None = None) -> None:
        self.plan, self.slurm = plan, slurm
        self.poll_s, self.kill_after_s = poll_s, kill_after_s
        self.job = BatchJob(plan, slurm, env, script, emit or _emit)
        self.files = self.job.files
        self.pool = NodePool([])
        self.step = 0
        self.stop_kind: str | None = None
        self.checked: set[str] = set()  # hosts the node check passed in this allocation
        self.probe: Probe | None = None  # the failed step's hosts, asked since its failure
        self.presumed: list[str] = []  # the failed step's hosts presumed lost before the probe's answer
        self.pending: tuple[Probe, list[str]] | None = None  # that answer, awaited beside the next step
        self.log: Path | None = None
        self.in_place = Survivors(self.files, slurm, SENTINEL, plan.recovery.requeue and plan.launch.task_log ==
                                  "rank" and Survivors.wanted(env, self.job.warn))

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
            self.job.end(status, self.step)
        return status

    def _loop(self) -> int:
        r = self.plan.recovery
        nodes = self.pool.choose(self.plan.nodes)
        while True:
            if nodes is None:
                lost, left_out = " ".join(self.pool.lost) or "none", " ".join(self.pool.left_out) or "none"
                self.job.warn(f"fewer than {self.plan.nodes} usable node(s) in this allocation (lost: {lost}, left "
                              f"out: {left_out})")
                return 1
            self.job.event("step_start", nodes, self.step)
            checked = self.preflight(nodes) if self.plan.node_check else nodes
            if isinstance(checked, Requeue):
                return self.requeue(checked, 0)
            nodes = checked
            ended = self.run_step(nodes)
            decision = self.decide(ended, nodes)
            if not isinstance(decision, Retry):
                self.in_place.release()
            if isinstance(decision, Finish):
                if r.requeue:
                    retried = f" after {self.step} retries in this allocation" if self.step else ""
                    self.job.say(f"finished (restart count {self.job.restart}){retried}")
                elif r.graceful_stop:
                    self.job.say("finished")
                self.job.sweep_done()
                return 0
            if isinstance(decision, Stop):
                return decision.status
            if isinstance(decision, Requeue):
                return self.requeue(decision, ended.status)
            self.job.report(self.step)
            self.step += 1
            nodes = decision.nodes
            self.job.say(f"crash (exit status {ended.status}): retrying in this allocation as step {self.step} on "
                         f"{','.join(nodes)} (no requeue)")

    # ------------------------------------------------------------------ one step
    def run_step(self, nodes: list[str]) -> StepEnd:
        """Launch the step on ``nodes``, wait for it; a step whose first task failed is killed ``teardown_grace_s``
        later if it has not ended, one with a host the probe found gone at once (a lost node never answers srun)."""
        self.files.step.clear()
        if self.step:
            self.files.mark_started()
            self.files.mark_attempt_in_logs(f"{self.job.restart}.{self.step}")
        if self.step or self.job.restart:
            self.job.event("relaunch", nodes, self.step)
        new, procs = self._launch(nodes)
        grace = base = self.plan.recovery.teardown_grace_s
        world = len(nodes) * self.plan.procs_per_node
        detected, why = False, ""
        failed_at = kill_at = None
        self.probe, self.presumed = None, []
        while True:
            self._reconcile()
            code = (new.returncode if new is not None else 0) if all(p.poll() is not None for p in procs) else None
            if code is not None:
                if not detected and (code != 0 or self.files.step.has_exits(self.step)):
                    self._detected(nodes)
                break
            now, grace = time.monotonic(), self.in_place.grace(self.step, base) if failed_at is not None else base
            exited = self.files.step.has_exits(self.step)
            if not detected and (exited or bool(self.files.step.peers_lost(self.step))):
                detected = True  # a rank that lost a peer says so before it leaves (fastexit): a lost node's sign
                self._detected(nodes)
            if failed_at is None and exited:
                failed_at, why = now, "the step did not end {:g} s after its first failure"
            late = self.in_place.late(self.step) if failed_at is None else []
            if late:  # a survivor that took the offer but never joined: the step did not start
                failed_at, why = now - grace, f"rank(s) {', '.join(map(str, late))} did not join job step " \
                    f"{self.step} within {self.in_place.join_s:g} s of its offer"
            if (failed_at is None or failed_at > now - grace) and why != GONE and self.probe is not None and \
                    (self.probe.found_lost() or (detected and self._presume_lost(nodes))):  # the others may wait
                failed_at, why = (failed_at or now) if self.in_place.enabled else now - grace, GONE
            gone = self._gone_ranks(nodes) if why == GONE else set()
            if failed_at is not None and kill_at is None and self.in_place.all_waiting(self.step, world, gone):
                self.in_place.hold(procs, self.step)  # not killed: the next step continues its waiting ranks
                code = next((x.code for x in self.files.step.exits(self.step)), 137)  # (a lost node's: killed)
                break
            if failed_at is not None and failed_at > now - grace and \
                    all_out(self.files, self.step, nodes, self.plan, gone):
                failed_at, why = now - grace, "every rank of the step has left or lost a peer"
            if failed_at is not None and kill_at is None and self.plan.recovery.requeue and now - failed_at >= grace:
                self.job.warn(f"{why.format(grace)}: killing its tasks")
                self.slurm.kill_steps(keep=SENTINEL)
                kill_at = now + self.kill_after_s  # srun itself, if Slurm's kill did not end it
            if kill_at is not None and now >= kill_at:
                for p in procs:
                    p.kill()
            time.sleep(self.poll_s)
        self.job.event("step_end", nodes, self.step)
        self.files.seal_logs()
        saved, finished = self.files.stop.answers()
        self.files.stop.clear()
        return StepEnd(first_failure(self.files, self.step, code if code >= 0 else 128 - code, self.job.warn),
                       saved, finished)

    def _launch(self, nodes: list[str]) -> tuple[subprocess.Popen[bytes] | None, list[subprocess.Popen[bytes]]]:
        """The step's new srun (None: a shrink continues every rank in place) and all its sruns (held ones too)."""
        beside = self.in_place.missing(nodes, self.plan.procs_per_node)
        env = self.step_env(nodes, beside)
        if beside is None:
            self.in_place.release()
            proc = self.slurm.launch(self.argv(nodes), env, self.job.cwd)
            return proc, [proc]
        self.in_place.offer(self.step, env, self.plan.procs_per_node)
        started = f"; starting rank(s) {', '.join(map(str, beside[1]))} on {beside[0]}" if beside[1] else ""
        self.job.say(f"rank(s) {', '.join(map(str, sorted(self.in_place.waiting)))} continue in place{started}")
        started_now = self.slurm.launch(self.argv(nodes, beside), env, self.job.cwd) if beside[1] else None
        return started_now, [*([started_now] if started_now is not None else []), *self.in_place.carried()]

    def _gone_ranks(self, nodes: list[str]) -> set[int]:
        """The ranks of the step on hosts presumed lost or found gone by the probe (so far)."""
        per, hosts = self.plan.procs_per_node, set(self.presumed) | (self.probe.gone() if self.probe else set())
        return {r for r in range(len(nodes) * per) if nodes[r // per] in hosts}

    def _detected(self, nodes: list[str]) -> None:
        """The step's first failure: recorded, and its hosts probed at once, while the step is torn down."""
        self.job.event("detected", nodes, self.step)
        if self.plan.recovery.requeue:
            self.probe = Probe(self.slurm, nodes)

    def _presume_lost(self, nodes: list[str]) -> bool:
        """A lost node's mark seen before the probe can answer (``presumed_lost``), where a spare can take its place:
        the step is killed at once and the next one launched on the spare while the probe still asks (a host that
        answers is usable again, ``_reconcile``); a shrink or a requeue waits for the probe."""
        silent = presumed_lost(self.files, self.step, nodes) if self.plan.launch.task_log == "rank" else []
        if not silent or len([h for h in self.pool.usable() if h not in silent]) < self.plan.nodes:
            return False
        self.presumed = silent
        self.job.event("presumed_lost", silent, self.step)
        return True

    def _reconcile(self) -> None:
        """The probe's answer on hosts presumed lost, once it is in (never waited for): one that answered after all
        is usable again -- a spare for a later failure."""
        if self.pending is None or not self.pending[0].done():
            return
        (probe, hosts), self.pending = self.pending, None
        back = [h for h, ok in probe.answers().items() if ok and h in hosts]
        if back:
            self.pool.recover(back)
            self.job.say(f"{','.join(back)} answered Slurm after all (presumed lost when its ranks fell silent): "
                         f"usable again, as a spare")
            self.job.event("answered", back, self.step)

    def argv(self, nodes: list[str], beside: tuple[str, list[int]] | None = None) -> list[str]:
        """The step's command: srun on ``nodes`` (with --requeue: exactly these, beside a failed step's remains; or
        only the ranks ``beside`` names, beside those waiting in place), every task through the exit-record
        wrapper, then the command and the program."""
        launch = self.plan.launch.on(len(nodes), self.plan.procs_per_node)
        srun = list(launch.srun)
        if self.plan.recovery.requeue:
            srun = self.in_place.srun(srun, nodes, launch.tasks_per_node, beside)
        command = [*launch.command, *([TORCHRUN_SIGNALS] if launch.torchrun and self.job.torchrun_signals else [])]
        program = [*launch.program, *(self.job.task_args if "CUSTOM_COMMAND" not in launch.env else [])]
        return [*srun, "bash", "-c", EXIT_RECORD_SH, "trainstack-task", launch.task_log, *command, *program]

    def step_env(self, nodes: list[str], beside: tuple[str, list[int]] | None = None) -> dict[str, str]:
        """The step's environment: the job's, the rendezvous on the step's first node (a port of its own for every
        step), the attempt's counters; restarts in place on, and the ranks of a step that starts only some."""
        port = self._port()
        job = self.slurm.job_id
        launch = self.plan.launch.on(len(nodes), self.plan.procs_per_node)
        env = {**self.job.env, **launch.env, "MASTER_ADDR": nodes[0], "MASTER_PORT": str(port),
               "PET_RDZV_ENDPOINT": f"{nodes[0]}:{port}",
               "PET_RDZV_ID": f"{job}.{self.step}" if self.plan.recovery.requeue else job,
               envvars.ATTEMPT: str(self.files.runs_before()), envvars.STEP: str(self.step)}
        if self.in_place.enabled:
            env[envvars.IN_PLACE] = "1"
        if beside is not None:
            env[envvars.TASK_RANKS] = f"{self.plan.procs_per_node}/{','.join(map(str, beside[1]))}"
            env[envvars.NPROCS] = str(len(nodes) * self.plan.procs_per_node)
        if len(nodes) < self.plan.nodes:  # a shrunk step: its own process count; the trainer keeps the global batch
            env[envvars.PLANNED_WORLD] = str(self.plan.nodes * self.plan.procs_per_node)
            env[envvars.NPROCS] = str(len(nodes) * self.plan.procs_per_node)
        if "CUSTOM_COMMAND" in env and self.job.task_args:
            env["CUSTOM_COMMAND"] += " " + " ".join(shlex.quote(a) for a in self.job.task_args)
        return env

    def _port(self) -> int:
        job, base, span = int(self.slurm.job_id), self.plan.port_base, self.plan.port_span
        if self.step == 0:
            return int(self.job.env.get("MASTER_PORT") or base + job % span)
        return base + (job + self.step * 7919) % span

    # ------------------------------------------------------------------ node checks
    def check_nodes(self, nodes: list[str]) -> dict[str, str]:
        """Measure every node of ``nodes`` (one task each, within the budget), judge them here: {host: why named}."""
        check = self.plan.node_check
        assert check is not None
        started = time.time()  # the ring meets at the step's first node (MASTER_ADDR), on the port after its own
        measure_nodes(self.slurm, self.files.node_check_dir, nodes, check.command, check.budget_s, self._port() + 1,
                      self.step_env(nodes))
        record = judge_nodes(self.files, nodes, started, self.plan.gpus_per_node, dict(check.thresholds),
                             self.job.restart, self.step)
        self.job.say(describe_check(record))
        for host, why in record["named"].items():
            self.job.say(f"node check: {host}: {why}")
        return dict(record["named"])

    def preflight(self, nodes: list[str]) -> list[str] | Requeue:
        """The nodes the step runs on after the check. Every usable host not yet checked is measured at once -- the
        spares with the step's nodes (the same seconds: one task per node, in parallel) -- so a spare that later
        takes a lost node's place steps in without a check of its own. A named node is left out and a checked
        spare takes its place; without one the job shrinks (``--min-nodes``) or is requeued leaving it out where
        the partition has other nodes, else it trains on them. A job without --requeue names the node and trains
        on it."""
        if not self.plan.recovery.requeue:
            found = self.check_nodes(nodes)
            if found:
                bad = ",".join(found)
                self.job.warn(f"training on {bad} anyway: a job without --requeue cannot leave a node out (--requeue "
                              f"--spare-nodes 1 replaces it; or resubmit with sbatch's --exclude={bad})")
            return nodes
        if set(nodes) <= self.checked:
            return nodes
        hosts = [h for h in self.pool.usable() if h not in self.checked]
        named = list(self.check_nodes(hosts))
        self.checked.update(h for h in hosts if h not in named)
        if not named or not set(named) & set(nodes):
            self.pool.leave_out(named)  # a named spare: the step's nodes stand
            return nodes
        self.pool.leave_out(named)
        chosen = self.pool.choose(self.plan.nodes)
        if chosen is not None:
            self.job.say(f"node check: leaving out {','.join(named)}; the step runs on {','.join(chosen)}")
            return chosen
        survivors = self.survivors(f"{','.join(named)} named by the node check")
        if survivors is not None:  # checked just now, with the node named
            return survivors
        budget = policy.Budget(policy.spent(self.files.folder, "nodecheck"), self.plan.recovery.max_retries)
        go, line = policy.node_check_failed(self.files.folder, named, budget, self._context(nodes))
        self.job.warn(line)
        if go:
            return Requeue("nodecheck", policy.excluded(self.files.folder))
        self.pool.readmit(named)
        self.checked.update(named)  # trained on as they are: not measured again in this allocation
        return self.pool.choose(self.plan.nodes) or nodes

    # ------------------------------------------------------------------ what comes next
    def decide(self, ended: StepEnd, nodes: list[str]) -> Decision:
        """What follows a step's end, through the one retry policy; every decision is said and recorded."""
        r, folder = self.plan.recovery, self.files.folder
        if ended.status == 0 and not ended.saved:
            return Finish()
        if not r.requeue:
            if ended.saved:
                self.job.say(f"stopped gracefully with a complete checkpoint ({self.stop_kind or 'timeout'}); not "
                             f"requeued (no --requeue): resubmit with resume='auto' to continue")
                return Stop(0)
            return Stop(ended.status)
        if self.files.cancelled():
            self.job.warn("cancelled (trainstack cancel): not requeueing")
            return Stop(ended.status or 1)
        kind = (self.stop_kind or "timeout") if ended.saved else "crash"
        if ended.finished and self.stop_kind and not ended.saved:  # the signal came after the run ended
            kind = self.stop_kind
        where = self._context(nodes)
        if kind == "crash":
            self._probe(nodes)
            budget = policy.Budget(policy.spent(folder, "crash"), r.max_retries, "--max-retries")
            go, line = policy.decide(folder, ended.status, tuple(r.retry_on), budget, where, self.log)
        else:
            limit = r.max_requeues if kind == "timeout" else None
            budget = policy.Budget(policy.spent(folder, kind), limit, "--max-requeues")
            go, line = policy.stopped(folder, ended.status, kind, budget, where)
        self.job.warn(line)
        if not go:
            return Stop(ended.status or 1)
        blamed = policy.history(folder)[-1].get("blamed") if kind == "crash" else None
        if blamed:
            self.pool.leave_out([blamed])
        left = self.slurm.seconds_left()
        if kind == "crash" and (left is None or left >= r.min_step_s):
            chosen = self.pool.choose(self.plan.nodes) or self.survivors(self._gone())
            if chosen is not None:
                return Retry(chosen)
        note = policy.history(folder)[-1].get("exclusion_note") if kind == "crash" else None
        if note:
            self.job.warn(note)
        return Requeue(kind, policy.excluded(folder))

    def survivors(self, why: str) -> list[str] | None:
        """Shrink, the rung between a spare and a requeue: with no spare left, the step runs on the usable nodes
        when at least ``--min-nodes`` are (the trainer keeps the global batch: ``TRAINSTACK_PLANNED_WORLD``)."""
        low, usable = self.plan.recovery.min_nodes, self.pool.usable()[: self.plan.nodes]
        if not low:
            return None
        if len(usable) < low:
            self.job.warn(f"only {len(usable)} usable node(s) left ({why}), fewer than --min-nodes {low}: the job "
                          f"is requeued")
            return None
        self.job.say(f"no spare left ({why}): continuing on {len(usable)} of {self.plan.nodes} nodes "
                     f"({','.join(usable)}) from the newest complete state, at its exact sample, without a requeue")
        self.job.event("shrink", usable, self.step, planned=self.plan.nodes, why=why)
        return usable

    def _gone(self) -> str:
        lost, out = ",".join(self.pool.lost), ",".join(h for h in self.pool.left_out if h not in self.pool.lost)
        return "; ".join(p for p in (f"{lost} lost" if lost else "", f"{out} left out" if out else "") if p) \
            or "a node is missing"

    def _probe(self, nodes: list[str]) -> None:
        """Every host of a failed step asked (a trivial step; started at the failure, see ``Probe``):
        one that does not answer is lost, named in ``lost`` with the ranks it ran."""
        per = self.plan.procs_per_node
        if self.presumed and self.probe is not None:  # the next step does not wait for Slurm's answer on them
            self.pending = (self.probe, list(self.presumed))
            answers = {h: h not in self.presumed for h in nodes}
        else:
            answers = (self.probe or Probe(self.slurm, nodes)).answers()
        lost = {h: list(range(i * per, i * per + per)) for i, h in enumerate(nodes) if not answers.get(h)}
        if lost:
            self.files.step.write_lost(lost)
            self.pool.lose(list(lost))

    def _context(self, nodes: list[str]) -> policy.Context:
        return policy.Context(self.job.restart, self.step, list(nodes), self.plan.procs_per_node,
                              int(self.job.env.get("SLURM_NNODES") or self.plan.allocated_nodes),
                              self.slurm.partition_nodes())

    def requeue(self, decision: Requeue, status: int) -> int:
        """The last rung: requeue the job (an array task by its own id), leaving out the hosts blamed, and release
        Slurm's hold on it where its owner may. SIGTERM from the requeue is ignored meanwhile (Slurm's KillWait)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.job.report(self.step)
        self.job.say(f"{decision.kind} (exit status {status}): requeueing job {self.job.requeue_id} as restart "
                     f"{self.job.restart + 1}")
        done = self.slurm.requeue(self.job.requeue_id, decision.exclude)
        if not done.done:
            self.job.warn(f"scontrol requeue {self.job.requeue_id} failed: {done.answer}")
            return status or 1
        if done.already:
            self.job.say(f"job {self.job.requeue_id} was already requeued (scontrol requeue)")
        self.job.keep_memory = True
        if done.excluded:
            self.job.say(f"the requeued attempt leaves out {','.join(decision.exclude)} (blamed by a verdict)")
        self.job.say(done.hold)
        return 0

    # ------------------------------------------------------------------ the job's start and end
    def _begin(self) -> None:
        """The job's record and environment, the pool of its hosts, the signals, the sentinel, the versions."""
        self.pool = NodePool(self.job.begin())
        self.log = self.slurm.log_path()  # the job's own log: what torchrun's agents said of their workers
        if self.plan.recovery.graceful_stop:
            signal.signal(signal.SIGUSR1, lambda *_: self._stop("timeout", "SIGUSR1"))
            signal.signal(signal.SIGUSR2, lambda *_: self._stop("timeout", "SIGUSR2"))
            signal.signal(signal.SIGTERM, lambda *_: self._stop("preempt", "SIGTERM"))
        else:
            signal.signal(signal.SIGTERM, _terminated)
        if self.plan.recovery.requeue:
            sentinel.start(self.slurm, self.files, self.pool.allocated, self.job.env, self.job.requeue_id,
                           int(self.job.env.get("SLURM_NNODES") or self.plan.allocated_nodes), self.job.restart)
        self.job.provenance(f"{(self.pool.choose(1) or ['?'])[0]}:{self._port()}")

    def _stop(self, kind: str, name: str) -> None:
        self.stop_kind = kind
        why = " (a preemption, or a plain scancel: Slurm sends both the same signal; trainstack cancel ends a job " \
              "without a requeue)" if kind == "preempt" and self.plan.recovery.requeue else ""
        self.job.say(f"{name} at {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}: asking the "
                     f"trainer to checkpoint and stop{why}")
        self.files.stop.request()


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


def _emit(line: str, error: bool) -> None:
    """A line of the job's log (stderr for what went wrong, as the batch shell wrote it)."""
    print(f"trainstack: {line}", file=sys.stderr if error else sys.stdout, flush=True)


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM to a job without a graceful stop (scancel, the time limit): the job's record says 143, never a
    success."""
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
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("trainstack: the allocation driver runs inside a Slurm job (no SLURM_JOB_ID): submit the script "
              "with sbatch", file=sys.stderr)
        return 1
    return Allocation(plan, Slurm(job), os.environ, Path(args[0]) if args else None).run()


if __name__ == "__main__":
    sys.exit(main())

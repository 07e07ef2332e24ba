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
from .nodecheck import check as judge_nodes
from .nodecheck import describe as describe_check
from .plan import Plan
from .slurmcmd import Slurm

__all__ = ["Allocation", "NodePool", "Finish", "Retry", "Requeue", "Stop", "main"]

#: What the job's interpreter says of itself, in its container (the provenance line of every attempt).
PROBE = ('import sys, torch; n = torch.cuda.nccl.version() if torch.cuda.is_available() else None; '
         'print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} nccl {n}")')
#: torchrun >= 2.9 forwards these to its workers; older ones stop on them (the stop then comes through the driver).
TORCHRUN_SIGNALS = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
HEARTBEAT_S = 5.0
SENTINEL = "trainstack-sentinel"  # the sentinel's job step: never killed with a failed training step


class NodePool:
    """The allocation's hosts in order, less those lost (no answer) and those left out (blamed, named)."""

    def __init__(self, allocated: list[str]) -> None:
        self.allocated = list(allocated)
        self.lost: list[str] = []
        self.left_out: list[str] = []

    def choose(self, count: int) -> list[str] | None:
        """The first ``count`` usable hosts, or None when fewer are left."""
        usable = [h for h in self.allocated if h not in self.lost and h not in self.left_out]
        return usable[:count] if len(usable) >= count else None

    def lose(self, hosts: list[str]) -> None:
        self.lost += [h for h in hosts if h not in self.lost]

    def leave_out(self, hosts: list[str]) -> None:
        self.left_out += [h for h in hosts if h not in self.left_out]

    def readmit(self, hosts: list[str]) -> None:
        self.left_out = [h for h in self.left_out if h not in hosts]


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
                 poll_s: float = 0.5, kill_after_s: float = 2.0,
                 emit: Callable[[str, bool], None] | None = None) -> None:
        self.plan, self.slurm, self.script = plan, slurm, script
        self.poll_s, self.kill_after_s = poll_s, kill_after_s
        self.env = dict(env)
        self.emit = emit or _emit
        self.restart = int(self.env.get("SLURM_RESTART_COUNT") or 0)
        array = self.env.get("SLURM_ARRAY_JOB_ID")
        self.task = self.env.get("SLURM_ARRAY_TASK_ID") if array else None
        self.job_dir = Path(plan.job_dir_prefix + (array or slurm.job_id))
        self.files = JobFiles(self.job_dir / f"task-{self.task}" if self.task is not None else self.job_dir)
        self.requeue_id = f"{array}_{self.task}" if array else slurm.job_id
        self.pool = NodePool([])
        self.step = 0
        self.stop_kind: str | None = None
        self.keep_memory = False
        self.torchrun_signals = False
        self.task_args: list[str] = []
        self.cwd: Path | None = None
        self.checked: set[tuple[str, ...]] = set()
        self._done = threading.Event()

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Run the job to its end; the job's exit status."""
        status = 1
        self._set_up()
        try:
            status = self._loop()
        except SystemExit as exc:  # SIGTERM without a graceful stop: what the batch shell's trap recorded
            status = int(exc.code) if isinstance(exc.code, int) else 1
        finally:
            self._end(status)
        return status

    def _loop(self) -> int:
        r = self.plan.recovery
        nodes = self.pool.choose(self.plan.nodes)
        while True:
            if nodes is None:
                self._warn(f"fewer than {self.plan.nodes} usable node(s) in this allocation (lost: "
                           f"{' '.join(self.pool.lost) or 'none'}, left out: {' '.join(self.pool.left_out) or 'none'})")
                return 1
            self._event("step_start", nodes)
            checked = self.preflight(nodes) if self.plan.node_check else nodes
            if isinstance(checked, Requeue):
                return self.requeue(checked, 0)
            nodes = checked
            ended = self.run_step(nodes)
            decision = self.decide(ended, nodes)
            if isinstance(decision, Finish):
                if r.requeue:
                    retried = f" after {self.step} retries in this allocation" if self.step else ""
                    self.say(f"finished (restart count {self.restart}){retried}")
                elif r.graceful_stop:
                    self.say("finished")
                self._sweep_done()
                return 0
            if isinstance(decision, Stop):
                return decision.status
            if isinstance(decision, Requeue):
                return self.requeue(decision, ended.status)
            self._report()
            self.step += 1
            nodes = decision.nodes
            self.say(f"crash (exit status {ended.status}): retrying in this allocation as step {self.step} on "
                     f"{','.join(nodes)} (no requeue)")

    # ------------------------------------------------------------------ one step
    def run_step(self, nodes: list[str]) -> StepEnd:
        """Launch the step on ``nodes``, wait for it; a step whose first task failed is killed ``teardown_grace_s``
        later if it has not ended (a lost node never answers srun)."""
        self.files.clear_step()
        if self.step:
            self.files.mark_started()
            self.files.mark_attempt_in_logs(f"{self.restart}.{self.step}")
        if self.step or self.restart:
            self._event("relaunch", nodes)
        proc = self.slurm.launch(self.argv(nodes), self.step_env(nodes), self.cwd)
        grace = self.plan.recovery.teardown_grace_s
        failed_at = kill_at = None
        while True:
            code = proc.poll()
            if code is not None:
                if failed_at is None and (code != 0 or self.files.has_exits()):
                    self._event("detected", nodes)
                break
            now = time.monotonic()
            if failed_at is None and self.files.has_exits():
                failed_at = now
                self._event("detected", nodes)
            if failed_at is not None and kill_at is None and self.plan.recovery.requeue and now - failed_at >= grace:
                self._warn(f"the step did not end {grace:g} s after its first failure: killing its tasks")
                self.slurm.kill_steps(keep=SENTINEL)
                kill_at = now + self.kill_after_s  # srun itself, if Slurm's kill did not end it
            if kill_at is not None and now >= kill_at:
                proc.kill()
            time.sleep(self.poll_s)
        self._event("step_end", nodes)
        saved, finished = self.files.stop_answers()
        self.files.clear_stop()
        return StepEnd(self._first_failure(code if code >= 0 else 128 - code), saved, finished)

    def _first_failure(self, status: int) -> int:
        """srun returns the largest status of its tasks, which after one failed is the SIGTERM (143) that
        --kill-on-bad-exit sent the others: the step's status is the first failing task's."""
        exits = self.files.exits()
        if status == 0 or not exits:
            return status
        first = exits[0]
        if first.code != status:
            at = datetime.datetime.fromtimestamp(first.time).strftime("%H:%M:%S")
            self._warn(f"{first.unit.replace('-', ' ', 1)} on {first.host} failed first (exit status {first.code} "
                       f"at {at}); srun's {status} is the stop of the others")
        return first.code

    def argv(self, nodes: list[str]) -> list[str]:
        """The step's command: srun on ``nodes`` (with --requeue: exactly these, beside a failed step's remains),
        every task through the exit-record wrapper, then the command and the program."""
        launch = self.plan.launch
        srun = list(launch.srun)
        if self.plan.recovery.requeue:
            srun += [f"--ntasks={len(nodes) * launch.tasks_per_node}", f"--nodelist={','.join(nodes)}", "--overlap"]
        command = [*launch.command, *([TORCHRUN_SIGNALS] if launch.torchrun and self.torchrun_signals else [])]
        program = [*launch.program, *(self.task_args if "CUSTOM_COMMAND" not in launch.env else [])]
        return [*srun, "bash", "-c", EXIT_RECORD_SH, "trainstack-task", launch.task_log, *command, *program]

    def step_env(self, nodes: list[str]) -> dict[str, str]:
        """The step's environment: the job's, the rendezvous on the step's first node (a port of its own for every
        step), the attempt's counters."""
        port = self._port()
        job = self.slurm.job_id
        env = {**self.env, **self.plan.launch.env, "MASTER_ADDR": nodes[0], "MASTER_PORT": str(port),
               "PET_RDZV_ENDPOINT": f"{nodes[0]}:{port}",
               "PET_RDZV_ID": f"{job}.{self.step}" if self.plan.recovery.requeue else job,
               envvars.ATTEMPT: str(self.files.runs_before()), envvars.STEP: str(self.step)}
        if "CUSTOM_COMMAND" in env and self.task_args:
            env["CUSTOM_COMMAND"] += " " + " ".join(shlex.quote(a) for a in self.task_args)
        return env

    def _port(self) -> int:
        job, base, span = int(self.slurm.job_id), self.plan.port_base, self.plan.port_span
        if self.step == 0:
            return int(self.env.get("MASTER_PORT") or base + job % span)
        return base + (job + self.step * 7919) % span

    # ------------------------------------------------------------------ node checks
    def check_nodes(self, nodes: list[str]) -> dict[str, str]:
        """Measure every node of ``nodes`` (one task each, within the budget), judge them here: {host: why named}."""
        check = self.plan.node_check
        assert check is not None
        started = time.time()
        out = self.files.node_check_dir
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        argv = [*check.command, "--out", str(out), "--port", str(self._port() + 1), "--budget", str(check.budget_s)]
        self.slurm.on_nodes(nodes, argv, timeout=check.budget_s, output=out / "srun.out", env=self.env)
        record = judge_nodes(self.files, nodes, started, self.plan.gpus_per_node, dict(check.thresholds),
                             self.restart, self.step)
        self.say(describe_check(record))
        for host, why in record["named"].items():
            self.say(f"node check: {host}: {why}")
        return dict(record["named"])

    def preflight(self, nodes: list[str]) -> list[str] | Requeue:
        """The nodes the step runs on after the check: a named node is left out and a spare takes its place
        (checked in turn); without one the job is requeued leaving it out where the partition has other nodes, else
        it trains on them. A job without --requeue names the node and trains on it."""
        if not self.plan.recovery.requeue:
            named = self.check_nodes(nodes)
            if named:
                bad = ",".join(named)
                self._warn(f"training on {bad} anyway: a job without --requeue cannot leave a node out (--requeue "
                           f"--spare-nodes 1 replaces it; or resubmit with sbatch's --exclude={bad})")
            return nodes
        while tuple(nodes) not in self.checked:
            named = list(self.check_nodes(nodes))
            if not named:
                break
            self.pool.leave_out(named)
            chosen = self.pool.choose(self.plan.nodes)
            if chosen is not None:
                self.say(f"node check: leaving out {','.join(named)}; the step runs on {','.join(chosen)}")
                nodes = chosen
                continue
            budget = policy.Budget(policy.spent(self.files.folder, "nodecheck"), self.plan.recovery.max_retries)
            go, line = policy.node_check_failed(self.files.folder, named, budget, self._context(nodes))
            self._warn(line)
            if go:
                return Requeue("nodecheck", policy.excluded(self.files.folder))
            self.pool.readmit(named)
            nodes = self.pool.choose(self.plan.nodes) or nodes
            break
        self.checked.add(tuple(nodes))
        return nodes

    # ------------------------------------------------------------------ what comes next
    def decide(self, ended: StepEnd, nodes: list[str]) -> Decision:
        """What follows a step's end, through the one retry policy; every decision is said and recorded."""
        r, folder = self.plan.recovery, self.files.folder
        if ended.status == 0 and not ended.saved:
            return Finish()
        if not r.requeue:
            if ended.saved:
                self.say(f"stopped gracefully with a complete checkpoint ({self.stop_kind or 'timeout'}); not "
                         f"requeued (no --requeue): resubmit with resume='auto' to continue")
                return Stop(0)
            return Stop(ended.status)
        if self.files.cancelled():
            self._warn("cancelled (trainstack cancel): not requeueing")
            return Stop(ended.status or 1)
        kind = (self.stop_kind or "timeout") if ended.saved else "crash"
        if ended.finished and self.stop_kind and not ended.saved:  # the signal came after the run ended
            kind = self.stop_kind
        where = self._context(nodes)
        if kind == "crash":
            self._probe(nodes)
            budget = policy.Budget(policy.spent(folder, "crash"), r.max_retries, "--max-retries")
            go, line = policy.decide(folder, ended.status, tuple(r.retry_on), budget, where)
        else:
            limit = r.max_requeues if kind == "timeout" else None
            budget = policy.Budget(policy.spent(folder, kind), limit, "--max-requeues")
            go, line = policy.stopped(folder, ended.status, kind, budget, where)
        self._warn(line)
        if not go:
            return Stop(ended.status or 1)
        blamed = policy.history(folder)[-1].get("blamed") if kind == "crash" else None
        if blamed:
            self.pool.leave_out([blamed])
        left = self.slurm.seconds_left()
        chosen = self.pool.choose(self.plan.nodes)
        if kind == "crash" and (left is None or left >= r.min_step_s) and chosen is not None:
            return Retry(chosen)
        return Requeue(kind, policy.excluded(folder))

    def _probe(self, nodes: list[str]) -> None:
        """Ask every host of a failed step (a trivial step, 5 s at most): one that does not answer is lost, named in
        ``lost`` with the ranks it ran."""
        answers = self.slurm.answering(nodes)
        per = self.plan.procs_per_node
        lost = {h: list(range(i * per, i * per + per)) for i, h in enumerate(nodes) if not answers.get(h)}
        if lost:
            self.files.write_lost(lost)
            self.pool.lose(list(lost))

    def _context(self, nodes: list[str]) -> policy.Context:
        return policy.Context(self.restart, self.step, list(nodes), self.plan.procs_per_node,
                              int(self.env.get("SLURM_NNODES") or self.plan.allocated_nodes),
                              self.slurm.partition_nodes())

    def requeue(self, decision: Requeue, status: int) -> int:
        """The last rung: requeue the job (an array task by its own id), leaving out the hosts blamed, and release
        Slurm's hold on it where its owner may. SIGTERM from the requeue is ignored meanwhile (Slurm's KillWait)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._report()
        self.say(f"{decision.kind} (exit status {status}): requeueing job {self.requeue_id} as restart "
                 f"{self.restart + 1}")
        done, answer = self.slurm.requeue(self.requeue_id)
        if not done:
            if "pending execution" not in answer:  # a user's own scontrol requeue got there first: nothing to add
                self._warn(f"scontrol requeue {self.requeue_id} failed: {answer}")
                return status or 1
            self.say(f"job {self.requeue_id} was already requeued (scontrol requeue)")
        self.keep_memory = True  # the requeued attempt restores from the memory checkpoints of the nodes it gets back
        if decision.exclude and self.slurm.exclude(self.requeue_id, decision.exclude):
            self.say(f"the requeued attempt leaves out {','.join(decision.exclude)} (blamed by a verdict)")
        if self.slurm.start_now(self.requeue_id):
            self.say("asked Slurm to start the requeued job without its hold (trainstack submit --wait releases "
                     "a hold set later)")
        return 0

    # ------------------------------------------------------------------ the job's start and end
    def _set_up(self) -> None:
        env, plan = self.env, self.plan
        if env.get("SLURM_NNODES") and env["SLURM_NNODES"] != str(plan.allocated_nodes):
            self._warn(f"this script was generated for {plan.allocated_nodes} node(s) but the job has "
                       f"{env['SLURM_NNODES']}")
            raise SystemExit(1)
        try:
            self.files.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._warn(f"cannot create the job folder {self.files.folder} ({exc.strerror}): is "
                       f"{self.job_dir.parent} writable from the compute nodes?")
            raise SystemExit(1) from None
        self._copy_script()
        self.files.clear_exit_code()
        self.files.mark_started()
        self.files.driver_started()
        self.files.mark_attempt_in_logs(str(self.restart))
        self.env[envvars.JOB_DIR] = str(self.files.folder)
        self.env.setdefault(envvars.SUBMIT_DIR, os.getcwd())
        self._event("job_start", None, submitted=self.slurm.submitted())
        threading.Thread(target=self._heartbeat, name="trainstack-heartbeat", daemon=True).start()
        self.pool = NodePool(self.slurm.hostnames(env.get("SLURM_JOB_NODELIST", "")) or
                             [env.get("SLURMD_NODENAME") or os.uname().nodename])
        self._start_sentinel()
        self._code_snapshot()
        self._sweep_task()
        if plan.gpu:  # the NCCL flight recorder: each rank's last collectives, dumped here when one times out
            self.env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            self.env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            self.env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(self.files.path("nccl-trace-rank-"))
        if plan.recovery.graceful_stop:
            self.env[envvars.STOP_FILE] = str(self.files.stop_file)
            self.env[envvars.STOP_SIGNALS] = "SIGUSR2,SIGTERM"
            self.files.clear_stop()
            signal.signal(signal.SIGUSR1, lambda *_: self._stop("timeout", "SIGUSR1"))
            signal.signal(signal.SIGUSR2, lambda *_: self._stop("timeout", "SIGUSR2"))
            signal.signal(signal.SIGTERM, lambda *_: self._stop("preempt", "SIGTERM"))
        else:
            signal.signal(signal.SIGTERM, _terminated)
        self._provenance()

    def _start_sentinel(self) -> None:
        """The batch host is a node too: with --requeue on several nodes, a sentinel on another node of the
        allocation requeues the job without this one should this driver's heartbeat stop (``sentinel.py``)."""
        here = self.env.get("SLURMD_NODENAME") or (self.pool.allocated[:1] or [""])[0]
        others = [h for h in self.pool.allocated if h != here]
        if not self.plan.recovery.requeue or not others:
            return
        package = str(Path(__file__).resolve().parents[2])  # this trainstack, also where it is a shipped copy
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), package) if p)}
        out = self.files.path("sentinel.out")  # written by the sentinel's node: this host may be gone
        argv = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={others[0]}", f"--job-name={SENTINEL}",
                f"--output={out}", "--open-mode=append", sys.executable, "-m", "trainstack._slurm.sentinel",
                str(self.files.folder), here, self.requeue_id,
                str(self.env.get("SLURM_NNODES") or self.plan.allocated_nodes), str(self.restart)]
        self.slurm.launch(argv, env, output=Path(os.devnull))

    def _stop(self, kind: str, name: str) -> None:
        self.stop_kind = kind
        self.say(f"{name} at {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}: asking the "
                 f"trainer to checkpoint and stop")
        self.files.request_stop()

    def _provenance(self) -> None:
        """The header of every attempt in the job's log: where it runs and the versions its interpreter reports
        (inside the image when there is one)."""
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        print(f"=== trainstack job {self.slurm.job_id} ({self.env.get('SLURM_JOB_NAME', '')}) restart {self.restart} "
              f"at {now}", flush=True)
        first = self.pool.choose(1) or ["?"]
        print(f"nodes: {self.env.get('SLURM_JOB_NODELIST', '')} ({self.env.get('SLURM_NNODES', '')}) master: "
              f"{first[0]}:{self._port()}", flush=True)
        code = PROBE
        if self.plan.launch.torchrun and self.plan.recovery.graceful_stop:
            code += ('\nfrom torch.distributed.run import get_args_parser\nprint("torchrun-signals", '
                     '"--signals-to-handle" in get_args_parser()._option_string_actions)')
        try:
            out = subprocess.run([*self.plan.probe, "-c", code], capture_output=True, text=True, timeout=120,
                                 env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL)
            text, ok = (out.stdout + out.stderr).strip(), out.returncode == 0
        except (OSError, subprocess.SubprocessError) as exc:
            text, ok = str(exc), False
        if ok:
            print(text.splitlines()[0] if text else "", flush=True)
        else:
            self._warn(f"{' '.join(self.plan.probe)} cannot report the versions: "
                       f"{text.splitlines()[-1] if text else 'no output'}")
        self.torchrun_signals = "torchrun-signals True" in text
        if self.plan.launch.torchrun and self.plan.recovery.graceful_stop and not self.torchrun_signals:
            self.say("this torchrun has no --signals-to-handle (torch < 2.9): signals sent to the job steps stop "
                     "torchrun; the graceful stop comes through the batch shell's trap")

    def _code_snapshot(self) -> None:
        """trainstack submit's code snapshot: the job (and its requeues) run that copy, not the files being edited
        meanwhile."""
        snapshot = self.env.get(envvars.SNAPSHOT)
        own = str(Path(__file__).resolve().parents[2])  # a driver shipped in the job folder is not the job's
        paths = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep)
                 if p and not (own.endswith(f"/{JobFiles.DRIVER}") and os.path.realpath(p) == own)]
        if snapshot is not None:
            code = self.job_dir / JobFiles.CODE
            if not (code / snapshot).is_dir():
                self._warn(f"the code snapshot {code / snapshot} is missing (job folder deleted?)")
                raise SystemExit(1)
            self.cwd = code / snapshot
            paths = [*([str(code / "src")] if (code / "src").is_dir() else []), str(code), *paths]
            self.say(f"running the code snapshot in {self.cwd}")
        if paths:
            self.env["PYTHONPATH"] = os.pathsep.join(paths)
        else:
            self.env.pop("PYTHONPATH", None)

    def _sweep_task(self) -> None:
        """A sweep: every array task appends its own arguments and trains in a run folder named by their
        signature."""
        sweep = self.plan.sweep
        if sweep is None:
            return
        index = self.env.get("SLURM_ARRAY_TASK_ID", "")
        if not index.isdigit() or int(index) >= len(sweep.tasks):
            self._warn(f"array task '{index}' is not one of the {len(sweep.tasks)} tasks of this sweep")
            raise SystemExit(1)
        task = sweep.tasks[int(index)]
        self.task_args = list(task["args"])
        run_dir = Path(sweep.folder) / task["signature"]
        self.env[envvars.RUN_DIR], self.env[envvars.SWEEP_ARGS] = str(run_dir), " ".join(self.task_args)
        if (run_dir / ".trainstack-done").exists():
            self.say(f"sweep task {index} ({task['signature']}) already finished in {run_dir}: skipping")
            raise SystemExit(0)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"sweep task {index} ({task['signature']}): {' '.join(self.task_args)}")

    def _sweep_done(self) -> None:
        if self.plan.sweep is not None and envvars.RUN_DIR in self.env:
            (Path(self.env[envvars.RUN_DIR]) / ".trainstack-done").touch()

    def _copy_script(self) -> None:
        target = self.job_dir / JobFiles.SCRIPT
        if self.script is not None and not target.exists():
            try:
                target.write_bytes(self.script.read_bytes())
            except OSError:
                pass

    def _end(self, status: int) -> None:
        """The job's exit status in its folder, its end in the timeline, the attempt report, and the memory
        checkpoints freed on every node still answering (kept for a requeued attempt, which restores from them)."""
        self.files.write_exit_code(status)
        self._event("job_end", None, status=status)
        self._report()
        folders = self.files.memory_folders()
        if folders and not self.keep_memory:
            script = ('while IFS= read -r d; do [[ "$d" == */trainstack-*/job-"$SLURM_JOB_ID"-* ]] && rm -rf -- '
                      '"$d"; done < "$1"')
            listing = str(self.files.path(JobFiles.MEMORY_FOLDERS))
            self.slurm.each(self.pool.allocated, ["bash", "-c", script, "_", listing], timeout=10)
            self.files.forget_memory_folders()
        self._done.set()
        self.files.driver_ended(f"exit {status}")

    def _report(self) -> None:
        """The attempt report of this job step (never fails the job)."""
        from .report import write_report

        try:
            write_report(self.files.folder, self.restart, self.step)
        except Exception as exc:  # noqa: BLE001 -- a report is a convenience, the job goes on
            self._warn(f"the attempt report could not be written: {type(exc).__name__}: {exc}")

    def _event(self, kind: str, nodes: list[str] | None, **extra: object) -> None:
        self.files.record_event(kind, attempt=self.restart, step_index=self.step,
                                nodes=",".join(nodes) if nodes else self.env.get("SLURM_JOB_NODELIST", ""), **extra)

    def _heartbeat(self) -> None:
        self.files.beat()
        while not self._done.wait(HEARTBEAT_S):
            self.files.beat()

    def say(self, line: str) -> None:
        self.emit(line, False)

    def _warn(self, line: str) -> None:
        self.emit(line, True)


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

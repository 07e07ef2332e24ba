"""One job on its batch host, around the steps the allocation driver runs: ``BatchJob`` keeps the job's record in
its folder (the runs in ``started``, the timeline, the exit status, the attempt reports, the heartbeat the sentinel
watches), the environment every step runs with (the job folder, the code snapshot, a sweep task's arguments, the
stop file, the NCCL flight recorder), the versions its interpreter reports, and at the end frees the memory
checkpoints on every node. Torch-free, stdlib only.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from .._common import envvars as envvars
from .._common import jobevents as events
from .._common.files import UntrustedFileError, atomic_write
from .._common.jobfiles import DRIVER_BEAT_S, FREE_MEMORY_SH, JobFiles
from .plan import Plan
from .rungs import Requeue
from .slurmcmd import Slurm

__all__ = ["BatchJob", "PROBE", "REPLACED"]

#: What the job's interpreter says of itself, in its container (the provenance line of every attempt).
PROBE = ('import sys, torch; n = torch.cuda.nccl.version() if torch.cuda.is_available() else None; '
         'print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda} nccl {n}")')
#: The exit status of a driver another one replaced (a sentinel took it for lost): the keeper stands aside.
REPLACED = 75


class BatchJob:
    """The job's record and environment on its batch host (``emit(line, error)`` writes a line of its log)."""

    def __init__(self, plan: Plan, slurm: Slurm, env: Mapping[str, str], script: Path | None,
                 emit: Callable[[str, bool], None]) -> None:
        self.plan, self.slurm, self.script, self.emit = plan, slurm, script, emit
        self.env = dict(env)
        self.restart = int(self.env.get("SLURM_RESTART_COUNT") or 0)
        array = self.env.get("SLURM_ARRAY_JOB_ID")
        self.task = self.env.get("SLURM_ARRAY_TASK_ID") if array else None
        self.job_dir = Path(plan.job_dir_prefix + (array or slurm.job_id))
        self.files = JobFiles.mine(self.job_dir / f"task-{self.task}" if self.task is not None else self.job_dir)
        self.requeue_id = f"{array}_{self.task}" if array else slurm.job_id
        self.host = self.env.get("SLURMD_NODENAME") or os.uname().nodename  # where this driver runs
        self.requeued = False
        self.hosts: list[str] = []
        self.keep_memory = False  # a requeued attempt restores from the memory checkpoints of the nodes it gets
        self.torchrun_signals = False
        self.task_args: list[str] = []
        self.cwd: Path | None = None
        self._done = threading.Event()

    def begin(self, takeover: int = 0) -> list[str]:
        """The job's start (``takeover``: a driver's after a dead one's, recorded as such): the job folder and its
        record, the timeline, the heartbeat, the code it runs, the sweep task, the environment of its steps. The
        allocation's hosts, in order."""
        env, plan = self.env, self.plan
        have, low = env.get("SLURM_NNODES", ""), plan.recovery.min_nodes
        if have and have != str(plan.allocated_nodes):
            if not (low and have.isdigit() and low <= int(have) < plan.allocated_nodes):
                self.warn(f"this script was generated for {plan.allocated_nodes} node(s) but the job has {have}")
                raise SystemExit(1)
            self.say(f"the job started with {have} of its {plan.allocated_nodes} node(s) (a requeue short of a "
                     f"spare; --min-nodes {low})")
        try:  # this user's, never writable by others: the driver and the ranks act on what they read in it
            if self.task is not None:
                JobFiles.mine(self.job_dir).make_own()
            self.files.make_own()
        except UntrustedFileError as exc:
            self.warn(f"refusing the job folder: {exc}")
            raise SystemExit(1) from None
        except OSError as exc:
            self.warn(f"cannot create the job folder {self.files.folder} ({exc.strerror}): is "
                      f"{self.job_dir.parent} writable from the compute nodes?")
            raise SystemExit(1) from None
        self._copy_script()
        self.files.clear_exit_code()
        self.files.mark_started()
        self.files.driver.started(self.host)
        self.files.driver.keep_plan(plan.to_json())
        self.files.mark_attempt_in_logs(str(self.restart))
        self.env[envvars.JOB_DIR] = str(self.files.folder)
        self.env.setdefault(envvars.SUBMIT_DIR, os.getcwd())
        if takeover:
            self.event("driver_takeover", None, 0, takeover=takeover)
        else:
            self.event("job_start", None, 0, submitted=self.slurm.submitted(), nnodes=env.get("SLURM_NNODES"))
        threading.Thread(target=self._heartbeat, name="trainstack-heartbeat", daemon=True).start()
        self.hosts = self.slurm.hostnames(env.get("SLURM_JOB_NODELIST", "")) or \
            [env.get("SLURMD_NODENAME") or os.uname().nodename]
        self._code_snapshot()
        self._sweep_task()
        debug = self.env.get("NCCL_DEBUG_FILE", "")
        if Path(debug).name == "nccl.%h.%p.log" and Path(debug).parent == self.job_dir.parent:
            # NCCL's init lines (--nccl-transport, --nccl-debug) in this job's folder, not the shared log folder:
            # `why` reads this job's own, never a concurrent job's or a planted one
            self.env["NCCL_DEBUG_FILE"] = str(self.files.path("nccl.%h.%p.log"))
        if plan.gpu:  # the NCCL flight recorder: each rank's last collectives, dumped here when one times out
            self.env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            self.env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            self.env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(self.files.path("nccl-trace-rank-"))
        if plan.recovery.graceful_stop:  # the trainer polls the stop file; signals reach this driver only
            self.env[envvars.STOP_FILE] = str(self.files.stop.file)
            self.env[envvars.STOP_SIGNALS] = "SIGUSR2,SIGTERM"
            self.files.stop.clear()
        return self.hosts

    def provenance(self, master: str) -> None:
        """The header of every attempt in the job's log: where it runs and the versions its interpreter reports
        (inside the image when there is one)."""
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        print(f"=== trainstack job {self.slurm.job_id} ({self.env.get('SLURM_JOB_NAME', '')}) restart {self.restart} "
              f"at {now}", flush=True)
        print(f"nodes: {self.env.get('SLURM_JOB_NODELIST', '')} ({self.env.get('SLURM_NNODES', '')}) master: "
              f"{master}", flush=True)
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
            self.warn(f"{' '.join(self.plan.probe)} cannot report the versions: "
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
                self.warn(f"the code snapshot {code / snapshot} is missing (job folder deleted?)")
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
            self.warn(f"array task '{index}' is not one of the {len(sweep.tasks)} tasks of this sweep")
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

    def sweep_done(self) -> None:
        if self.plan.sweep is not None and envvars.RUN_DIR in self.env:
            (Path(self.env[envvars.RUN_DIR]) / ".trainstack-done").touch()

    def _copy_script(self) -> None:
        target = self.job_dir / JobFiles.SCRIPT
        if self.script is not None and not os.path.lexists(target):
            try:
                atomic_write(target, self.script.read_bytes(), mode=0o600)  # --env values may be secrets
            except OSError:
                pass

    def end(self, status: int, step: int, lost: list[str] | None = None) -> None:
        """The job's exit status in its folder, its end in the timeline, the attempt report, and the memory
        checkpoints freed on every node still answering (kept for a requeued attempt, which restores from them; a
        ``lost`` node's went with it)."""
        self.files.write_exit_code(status)
        self.event("job_end", None, step, status=status)
        self.report(step)
        folders = self.files.memory.folders()
        ran = [h for h in events.step_hosts(self.files.folder) if h not in (lost or [])]  # not the idle spares
        hosts = self.files.memory.left_on(ran, self.plan.procs_per_node)  # not where every rank freed its own
        if folders and not self.keep_memory and not hosts:
            self.files.memory.forget()
        if folders and not self.keep_memory and hosts:  # the folders are computed on each node, not listed
            answers = self.slurm.each(hosts, ["bash", "-c", FREE_MEMORY_SH, "_", self.slurm.job_id,
                                                   *self.files.memory.roots()], timeout=10)
            missed = [host for host, ok in answers.items() if not ok]
            if missed:  # a cancelled job starts no step: the listing stays for the command that frees them
                self.warn(f"memory checkpoints not freed on {','.join(missed)} (no job step ran there): "
                          f"`trainstack checkpoint free-memory {self.requeue_id}` frees them")
            else:
                self.files.memory.forget()
        self._done.set()
        self.files.driver.ended(f"exit {status}")

    def finished(self, step: int) -> int:
        """The run finished (said where the job could have retried or stopped): the job's status, 0."""
        r = self.plan.recovery
        if r.requeue:
            retried = f" after {step} retries in this allocation" if step else ""
            self.say(f"finished (restart count {self.restart}){retried}")
        elif r.graceful_stop:
            self.say("finished")
        self.sweep_done()
        return 0

    def requeue(self, decision: Requeue, status: int, step: int) -> int:
        """The last rung: requeue the job (an array task by its own id), leaving out the hosts blamed, and release
        Slurm's hold on it where its owner may; the job's status. SIGTERM from the requeue is ignored meanwhile
        (Slurm's KillWait)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.report(step)
        self.say(f"{decision.kind} (exit status {status}): requeueing job {self.requeue_id} as restart "
                 f"{self.restart + 1}")
        low = self.plan.recovery.min_nodes  # short of a spare, the requeued attempt may start with what it gets
        done = self.slurm.requeue(self.requeue_id, decision.exclude,
                                  f"{low}-{self.plan.allocated_nodes}" if low else "")
        if not done.done:
            self.warn(f"scontrol requeue {self.requeue_id} failed: {done.answer}")
            return status or 1
        if done.already:
            self.say(f"job {self.requeue_id} was already requeued (scontrol requeue)")
        self.keep_memory = self.requeued = True
        if done.excluded:
            self.say(f"the requeued attempt leaves out {','.join(decision.exclude)} (blamed by a verdict)")
        self.say(done.hold)
        return 0

    def report(self, step: int) -> None:
        """The attempt report of this job step (never fails the job)."""
        from .report import write_report

        try:
            write_report(self.files.folder, self.restart, step)
        except Exception as exc:  # noqa: BLE001 -- a report is a convenience, the job goes on
            self.warn(f"the attempt report could not be written: {type(exc).__name__}: {exc}")

    def event(self, kind: str, nodes: list[str] | None, step: int, **extra: object) -> None:
        """One entry of the job's timeline (``events.jsonl``: the goodput ledger and the recoveries read it)."""
        self.files.record_event(kind, attempt=self.restart, step_index=step,
                                nodes=",".join(nodes) if nodes else self.env.get("SLURM_JOB_NODELIST", ""), **extra)

    def _heartbeat(self) -> None:
        """The driver's heartbeat, every ``DRIVER_BEAT_S``; a driver that another one replaced (a sentinel took its
        host for lost) stops at once: two drivers of one allocation would fight over its steps."""
        me = (self.host, os.getpid())
        self.files.driver.beat()
        while not self._done.wait(DRIVER_BEAT_S):
            now = self.files.driver.host()
            if self.files.driver.replaced(*me):
                self.warn(f"the driver on {now[0] if now else '?'} has taken this allocation over (this host was "
                          f"taken for lost): the driver on {self.host} stops")
                os._exit(REPLACED)
            self.files.driver.beat()

    def say(self, line: str) -> None:
        self.emit(line, False)

    def warn(self, line: str) -> None:
        self.emit(line, True)

"""The batch host is a node too: a sentinel on another node of the allocation notices when the job's driver is gone
and takes its place.

A ``--requeue`` job keeps its allocation when a node fails (``#SBATCH --no-kill``, so that spares can take over), and
the driver runs on the first node. When *that* node is lost, Slurm kills only the batch step and the job goes on
``RUNNING`` on its other nodes (Slurm later takes the lost host out of it) -- with no process of it left. So the
driver starts this sentinel as a one-task step on another node (``srun --overlap``). It watches the driver's
heartbeat (``driver.alive``, touched every second by a thread of the driver's own) by its *changes*, on its own
clock (another node's clock may be seconds off): after ``DRIVER_SUSPECT_S`` without a beat it asks Slurm whether the
batch host answers a trivial step, and one that does not is lost -- the sentinel records the loss (a ``node
failure`` verdict blaming the host, a ``driver_lost`` event) and ``takeover.py`` takes the driver's place in the
same allocation. A driver silent for ``SILENT_S`` on a host that still answers (hung) is requeued around, leaving
that host out -- the same requeue the driver does, through the same Slurm calls. When the driver ends, the sentinel
stands down. Torch-free, stdlib only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .._common import jobevents as events
from .._common.jobfiles import DRIVER_SILENT_S, DRIVER_SUSPECT_S, JobFiles
from . import attempt as policy
from .slurmcmd import Slurm
from .verdict import last_step

__all__ = ["SILENT_S", "STEP_NAME", "Gone", "start", "watch", "record_loss", "requeue_without", "job_env", "say"]

SILENT_S = DRIVER_SILENT_S
STEP_NAME = "trainstack-sentinel"  # the sentinel's job step: never killed with a failed training step
#: What srun sets for a step's task (a sentinel's own step) that the job's driver must not inherit: its steps are
#: the job's, sized by the plan, never by the sentinel's one task on one node.
STEP_ONLY = ("SLURM_STEP_", "SLURM_SRUN_COMM_", "SLURM_CPU_BIND", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_TASK_PID",
             "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_GTIDS", "SLURM_NTASKS", "SLURM_NPROCS",
             "SLURM_TASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_UMASK", "SLURM_PRIO_PROCESS")


@dataclass(frozen=True)
class Gone:
    """The driver is gone: ``silent`` seconds without a beat; ``lost``: its host did not answer Slurm either."""

    silent: float
    lost: bool


def start(slurm: Slurm, files: JobFiles, allocated: list[str], env: Mapping[str, str], requeue_id: str, need: int,
          restart: int) -> str | None:
    """Start the sentinel on another node of ``allocated`` than the batch host (none with a single node): it takes
    the driver's place should the batch host be lost (``takeover.py``). The host it runs on (None: none)."""
    here = env.get("SLURMD_NODENAME") or (allocated[:1] or [""])[0]
    others = [h for h in allocated if h != here]
    if not others:
        return None
    package = str(Path(__file__).resolve().parents[2])  # this trainstack, also where it is a shipped copy
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), package) if p)  # not the job's code snapshot
    step_env = {**job_env(os.environ), "PYTHONPATH": path}
    out = files.path("sentinel.out")  # written by the sentinel's node: the batch host may be gone
    argv = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={others[0]}", f"--job-name={STEP_NAME}",
            f"--output={out}", "--open-mode=append", sys.executable, "-m", "trainstack._slurm.takeover",
            str(files.folder), here, requeue_id, str(need), str(restart)]
    files.driver.watched_from(others[0])
    slurm.launch(argv, step_env, output=Path(os.devnull))
    return others[0]


def watch(files: JobFiles, slurm: Slurm, batch_host: str, suspect_s: float = DRIVER_SUSPECT_S,
          silent_s: float = SILENT_S, poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
          control: str | None = None) -> Gone | None:
    """Watch until the driver ends (None) or is gone (``Gone``): its heartbeat unchanged for ``suspect_s`` and its
    host not answering Slurm (asked again every ``suspect_s`` while the silence lasts; beside ``control``, the
    sentinel's own node, whose quick answer bounds the wait for a lost one's), or unchanged for ``silent_s``
    whatever the host says. None: the driver ended, or another sentinel has taken over this one's duty."""
    beat, since, asked = files.driver.last_beat(), clock(), None
    while True:
        if files.driver.has_ended() or (control and files.driver.sentinel_host() not in (None, control)):
            return None  # the driver ended, or a sentinel started since (this node taken for lost) watches it
        now, seen = clock(), files.driver.last_beat()
        if seen != beat:
            beat, since, asked = seen, now, None
        silent = now - since
        if silent > silent_s:
            return Gone(silent, lost=False)
        if silent > suspect_s and (asked is None or now - asked > suspect_s):
            asked = now
            if not slurm.answering([batch_host, *([control] if control else [])]).get(batch_host, False):
                return Gone(clock() - since, lost=True)
        time.sleep(poll_s)


def record_loss(files: JobFiles, slurm: Slurm, batch_host: str, gone: Gone, need: int, restart: int,
                decision: str) -> list[str]:
    """The loss in the job's records: a ``node failure`` verdict blaming the batch host, a ``driver_lost`` event.
    The hosts a requeue would leave out."""
    keep, note = policy.exclusions([*(r.get("blamed") for r in policy.history(files.folder)), batch_host],
                                   slurm.partition_nodes(), need)
    steps = [e.get("step_index") for e in events.read(files.folder, kind="step_start") if e.get("attempt") == restart]
    index = steps[-1] if steps and isinstance(steps[-1], int) else 0  # the job step the driver was running
    how = "did not answer Slurm" if gone.lost else "still answers Slurm, the driver hung"
    files.append_verdict({"attempt": restart, "step_index": index, "category": "crash", "kind": "node failure",
                          "summary": f"batch host lost: {batch_host} (the job's driver stopped answering)",
                          "cause": f"node failure: batch host lost: {batch_host}", "rank": None, "host": batch_host,
                          "blamed": batch_host, "step": last_step(files.folder), "status": 1,
                          "fault_time": time.time() - gone.silent, "time": time.time(), "retried": True,
                          "excluded": keep, "decision": decision + (f"; {note}" if note else "")})
    files.record_event("driver_lost", host=batch_host, silent_s=round(gone.silent, 1), attempt=restart,
                       step_index=index, answered=not gone.lost, how=how)
    return keep


def requeue_without(files: JobFiles, slurm: Slurm, batch_host: str, gone: Gone, requeue_id: str, need: int,
                    restart: int = 0, log: Path | None = None, nodes: str = "") -> str:
    """The job requeued leaving ``batch_host`` out (said, recorded; ``nodes``: the MIN-MAX count it may start
    with); what was done."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue signals this step too: finish the requeue first
    line = (f"the batch host {batch_host} was lost: the job's driver has not answered for {gone.silent:.0f} s; "
            f"requeueing without it")
    keep = record_loss(files, slurm, batch_host, gone, need, restart, line)
    say(line, log)
    done = slurm.requeue(requeue_id, keep, nodes)
    if not done.done:
        say(f"scontrol requeue {requeue_id} failed: {done.answer}; trainstack cancel the job (it holds its nodes "
            f"with no process of it running)", log)
        files.record_event("driver_lost_requeue_failed", answer=done.answer, attempt=restart)
        return "requeue failed"
    if done.excluded:
        say(f"the requeued attempt leaves out {','.join(keep)}", log)
    say(done.hold, log)
    files.driver.ended(f"requeued by the sentinel: {batch_host} lost")
    return "requeued"


def job_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The job's environment as its batch script had it, from a sentinel step's (srun sets the step's own node and
    task counts and ids): what a driver taking over runs its steps with."""
    env = {k: v for k, v in environ.items() if not k.startswith(STEP_ONLY)}
    if environ.get("SLURM_JOB_NUM_NODES"):
        env["SLURM_NNODES"] = environ["SLURM_JOB_NUM_NODES"]
    if environ.get("SLURM_JOB_NODELIST"):
        env["SLURM_NODELIST"] = environ["SLURM_JOB_NODELIST"]
    return env


def say(line: str, log: Path | None) -> None:
    """A line in the sentinel's own output and in the job's log (the driver that wrote there is gone)."""
    text = f"trainstack: {line} (sentinel)"
    print(text, flush=True)
    if log is not None:
        try:
            with open(log, "a") as fh:
                fh.write(text + "\n")
        except OSError:
            pass

"""``python -m trainstack._slurm.takeover TASK_DIR BATCH_HOST REQUEUE_ID NODES RESTART``: the sentinel's process. It
watches the job's driver from another node (``sentinel.watch``) and, when the batch host is lost, becomes the
allocation's driver in the same allocation: the dead driver's job steps killed, the lost host left out, the next
step launched on the nodes left (a spare in its place, or fewer nodes where ``--min-nodes`` allows: the same ladder
the driver climbs), a new sentinel started on another node to watch *this* driver -- no requeue, no wait for Slurm's
scheduler. Slurm lets the job go on without its batch host (``--no-kill``), but nothing ends it when its batch
script is gone: this driver ends it (``scancel``) once the run is over, after recording the job's exit status, which
``status`` and ``why`` read over Slurm's CANCELLED.

Where it cannot take over (no plan kept in the job folder, ``TAKEOVERS`` already in this attempt, or a driver silent
on a host that still answers), it requeues the job without the batch host as before. Torch-free, stdlib only.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from .._common.jobfiles import JobFiles
from . import sentinel
from .allocation import Allocation
from .keeper import TAKEOVERS
from .plan import Plan
from .sentinel import Gone
from .slurmcmd import Slurm

__all__ = ["take_over", "main"]


def take_over(files: JobFiles, slurm: Slurm, batch_host: str, gone: Gone, requeue_id: str, need: int, restart: int,
              log: Path | None) -> int:
    """The driver's place taken in this allocation where it can be, else the job requeued without ``batch_host``;
    the job's exit status."""
    plan, why = _plan(files)
    done = sum(1 for e in files.events() if e.get("kind") == "driver_takeover" and e.get("attempt") == restart)
    here = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    if not files.driver.claim(files.driver.host()):  # another sentinel got there first (a partitioned node's)
        sentinel.say(f"another sentinel has taken the place of the driver on {batch_host}: this one stands down", log)
        return 0
    if plan is None or not gone.lost or done >= TAKEOVERS:
        if plan is None:
            sentinel.say(f"cannot take the driver's place ({why})", log)
        low = plan.recovery.min_nodes if plan is not None else None
        nodes = f"{low}-{plan.allocated_nodes}" if plan is not None and low else ""
        return 0 if sentinel.requeue_without(files, slurm, batch_host, gone, requeue_id, need, restart, log,
                                             nodes) == "requeued" else 1
    line = (f"the batch host {batch_host} was lost (the job's driver silent for {gone.silent:.0f} s, the host not "
            f"answering Slurm): the driver's place is taken on {here} in this allocation (takeover {done + 1} of "
            f"{TAKEOVERS}), without a requeue")
    sentinel.record_loss(files, slurm, batch_host, gone, need, restart, line)
    sentinel.say(line, log)
    slurm.kill_steps(keep=sentinel.STEP_NAME)  # the dead driver's steps: their ranks wait on the lost host's
    _output_to(log)
    env = sentinel.job_env(os.environ)
    alloc = Allocation(plan, slurm, env, takeover=done + 1, lost_host=batch_host)
    status = alloc.run()
    if not alloc.job.requeued:  # no batch script is left to end the job: its driver does, its status recorded first
        files.record_event("job_closed", attempt=restart, status=status, host=here)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        slurm.end(requeue_id)
    return status


def _plan(files: JobFiles) -> tuple[Plan | None, str]:
    """The plan the first driver kept in the job folder (its owner's only), or why there is none."""
    text = files.driver.plan()
    if not text:
        return None, f"no plan of the job's owner in {files.path(JobFiles.PLAN)}"
    try:
        return Plan.from_json(text), ""
    except ValueError as exc:
        return None, f"the job's plan cannot be read: {exc}"


def _output_to(log: Path | None) -> None:
    """This process's output -- the driver's lines, its steps' -- to the job's log (the batch script's is gone)."""
    if log is None:
        return
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> int:
    folder, batch_host, requeue_id, need, restart = argv[1], argv[2], argv[3], int(argv[4]), int(argv[5])
    slurm = Slurm(os.environ.get("SLURM_JOB_ID", requeue_id.split("_")[0]), sentinel.job_env(os.environ))
    files = JobFiles.mine(Path(folder))
    files.record_event("sentinel_start", host=os.environ.get("SLURMD_NODENAME", ""), watching=batch_host,
                       attempt=restart)
    log = slurm.log_path()
    try:
        gone = sentinel.watch(files, slurm, batch_host, control=os.environ.get("SLURMD_NODENAME"))
        return 0 if gone is None else take_over(files, slurm, batch_host, gone, requeue_id, need, restart, log)
    except Exception as exc:  # its own output goes to an srun that may be gone: the job's log and events say it
        files.record_event("sentinel_failed", error=f"{type(exc).__name__}: {exc}", attempt=restart)
        sentinel.say(f"the sentinel failed ({type(exc).__name__}: {exc}); a lost batch host is no longer "
                     f"recovered by it", log)
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""``trainstack checkpoint free-memory JOB``: the memory checkpoints a job left in its nodes' ``/dev/shm`` -- a plain
``scancel`` of a ``--requeue`` job (Slurm requeues it, so they are kept for the next attempt), a lost batch host, a
``kill -9`` -- freed with one command: a one-task step on each node the job ran on removes that job's folders only.
Refused while the job may still run again (a requeued attempt restores from them). Torch-free."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .._common import jobevents as jobevents
from .._common.jobfiles import FREE_MEMORY_SH, JobFiles
from .jobs import JobError
from .status import job_status

__all__ = ["free_memory"]

_LIVE = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "RESIZING")


def free_memory(job_id: str, wait_s: int = 60) -> tuple[list[str], list[str]]:
    """Free ``job_id``'s memory checkpoint folders on every node it ran on: (the hosts, the folders); nothing to
    free gives two empty lists. A JobError names what stands in the way and how to do it by hand."""
    rows = job_status(job_id)
    live = [r for r in rows if r.state.split()[0].rstrip("+") in _LIVE]
    if live:
        raise JobError(f"job {job_id} is {live[0].state.split()[0].lower()}: a requeued attempt restores from its "
                       f"memory checkpoints. HINT: trainstack cancel {job_id} ends it (and frees them).")
    folder = next((Path(r.folder) for r in rows if r.folder), None)
    if folder is None:
        raise JobError(f"job {job_id} has no job folder here: its memory checkpoints are not recorded. HINT: on each "
                       f"node, rm -rf /dev/shm/trainstack-$(id -u)/job-{job_id}-*")
    files = JobFiles.mine(folder)  # what it deletes is computed on each node: this job's folders in this user's root
    folders = files.memory.folders()
    if not folders:
        return [], []
    hosts = files.memory.left_on(jobevents.step_hosts(folder), _ranks_per_node(files))
    if not hosts and jobevents.step_hosts(folder):  # every rank freed its own: nothing is left
        files.memory.forget()
        return [], []
    if not hosts:
        raise JobError(f"job {job_id}'s folder {folder} does not say which nodes it ran on. HINT: on each node, "
                       f"rm -rf {' '.join(folders)}")
    partition = _partition(files)
    argv = ["srun", f"--immediate={wait_s}", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}",
            "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}", "--job-name=trainstack-free-memory",
            *([f"--partition={partition}"] if partition else []), "bash", "-c", FREE_MEMORY_SH, "_",
            job_id.partition("_")[0], *files.memory.roots()]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=wait_s + 60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JobError(f"could not run srun on {','.join(hosts)}: {exc}. HINT: on each of them, rm -rf "
                       f"{' '.join(folders)}") from None
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no answer"]
        raise JobError(f"srun on {','.join(hosts)} did not free them ({why[0]}): a node busy with another job "
                       f"(--immediate={wait_s} s) or down. HINT: run it again later, or on each node: rm -rf "
                       f"{' '.join(folders)}")
    files.memory.forget()
    return hosts, folders


def _partition(files: JobFiles) -> str | None:
    spec = files.metadata().get("spec") or {}
    value = spec.get("partition") if isinstance(spec, dict) else None
    return str(value) if value else None


def _ranks_per_node(files: JobFiles) -> int:
    """The processes per node the job's plan ran (its driver kept the plan); unknown: no node counts as freed."""
    try:
        value = json.loads(files.driver.plan() or "{}").get("procs_per_node")
    except (ValueError, AttributeError):
        value = None
    return value if isinstance(value, int) and value > 0 else 1 << 30

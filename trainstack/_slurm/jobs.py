"""Slurm jobs after submission: what ``scontrol`` knows of a job, its job folder, and ``trainstack debug`` (every
rank's stacks from a running job, without stopping it). Torch-free."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrainstackError
from .jobfolder import JobPaths

__all__ = ["JobError", "JobInfo", "job_info", "job_infos", "job_folder", "debug_job", "check_job_id"]


class JobError(TrainstackError, RuntimeError):
    """A job that does not exist, is not running, or cannot be reached."""


@dataclass
class JobInfo:
    job_id: str
    name: str
    state: str
    nodes: str
    num_nodes: int
    stdout: str | None
    work_dir: str | None
    elapsed: str
    restarts: int
    exit_code: str | None
    array_job_id: str | None = None
    array_task_id: str | None = None  # one index, or a pending range like "2-3%2"
    reason: str | None = None  # why a pending job waits
    user: str | None = None  # scontrol's UserId, "name(uid)"
    start_time: str | None = None  # a pending job's expected (or held-until) start, scontrol's StartTime

    @property
    def uid(self) -> int | None:
        m = re.search(r"\((\d+)\)", self.user or "")
        return int(m.group(1)) if m else None

    def check_mine(self, action: str) -> None:
        """Refuse to act on another user's job (Slurm would refuse too, after trainstack wrote into its folder)."""
        if self.uid is not None and self.uid != os.getuid() and os.getuid() != 0:
            raise JobError(f"job {self.label} belongs to {self.user}, not to you: trainstack can {action} only your "
                           f"own jobs.")

    @property
    def paths(self) -> JobPaths | None:
        """This job's folder and log paths (None when Slurm does not say where its output goes)."""
        if not self.stdout:
            return None
        task_id = self.array_task_id or ""
        task = int(task_id) if self.array_job_id is not None and task_id.isdigit() else None
        return JobPaths.of_log(self.stdout, self.name, self.array_job_id or self.job_id, task)

    @property
    def label(self) -> str:
        """``123`` for a plain job, ``123_4`` for an array task, ``123_[2-3]`` for pending tasks."""
        if self.array_job_id is None:
            return self.job_id
        task = (self.array_task_id or "").split("%")[0]
        return f"{self.array_job_id}_{task}" if task.isdigit() else f"{self.array_job_id}_[{task}]"


def check_job_id(job_id: str) -> str:
    """A Slurm job id (digits, or ``<array job>_<task>``), else a clear error."""
    if not re.fullmatch(r"\d+(_\d+)?", job_id) or int(job_id.split("_")[0]) == 0:
        raise JobError(f"{job_id!r} is not a Slurm job id (digits, or <array job>_<task> for an array task, e.g. "
                       f"1234 or 1234_0; 0 is not a job).")
    return job_id


def _field(text: str, name: str) -> str | None:
    m = re.search(rf"(?:^|\s){name}=(\S*)", text)
    return m.group(1) if m else None


def job_infos(job_id: str) -> list[JobInfo]:
    """What ``scontrol show job`` says, one entry per job (every task of an array job); empty once Slurm has
    forgotten the job (``MinJobAge`` after it ended)."""
    check_job_id(job_id)
    if shutil.which("scontrol") is None:
        raise JobError("scontrol not found on PATH. HINT: run this on a Slurm login node.")
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 and "_" in job_id and "not found" in proc.stdout + proc.stderr:
        base = job_id.split("_")[0]
        if any(i.array_job_id is None for i in job_infos(base)):
            raise JobError(f"job {base} is not an array job, so it has no task {job_id.split('_')[1]}. HINT: "
                           f"trainstack status {base}")
        return []
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        raise JobError(f"scontrol could not answer: {proc.stderr.strip() or proc.stdout.strip()}")
    out = []
    for text in proc.stdout.splitlines():
        if "JobId=" not in text:
            continue
        array = _field(text, "ArrayJobId")
        out.append(JobInfo(job_id=_field(text, "JobId") or job_id, name=_field(text, "JobName") or "",
                           state=_field(text, "JobState") or "UNKNOWN", nodes=_field(text, "NodeList") or "",
                           num_nodes=_leading_int(_field(text, "NumNodes")), stdout=_field(text, "StdOut"),
                           work_dir=_field(text, "WorkDir"), elapsed=_field(text, "RunTime") or "",
                           restarts=_leading_int(_field(text, "Restarts")), exit_code=_field(text, "ExitCode"),
                           array_job_id=array, array_task_id=_field(text, "ArrayTaskId") if array else None,
                           reason=_field(text, "Reason"), user=_field(text, "UserId"),
                           start_time=_field(text, "StartTime")))
    return sorted(out, key=lambda i: (int(i.array_job_id or i.job_id), _task_key(i.array_task_id)))


def _leading_int(value: str | None) -> int:
    """``"2"`` -> 2; a pending job's ``"1-1"`` -> 1; missing -> 0."""
    head = re.match(r"\d+", value or "")
    return int(head.group()) if head else 0


def _task_key(task: str | None) -> int:
    head = re.match(r"\d+", task or "")
    return int(head.group()) if head else -1


def job_info(job_id: str) -> JobInfo | None:
    """The one job ``job_id`` names (an array task by ``<array>_<task>``); None when Slurm no longer knows it."""
    infos = job_infos(job_id)
    if "_" in job_id:
        return next((i for i in infos if i.label == job_id), infos[0] if infos else None)
    return infos[0] if infos else None


def job_folder(info: JobInfo) -> Path | None:
    """``<log_dir>/<job name>-<job id>`` (``.../task-<i>`` for an array task): the log's folder holds it."""
    paths = info.paths
    if paths is None:
        return None
    folder = paths.folder
    try:
        return folder if folder.is_dir() else None
    except OSError:  # another user's folder we may not look into
        return None


def debug_job(job_id: str, wait_s: float = 30.0, echo: Callable[[str], None] = print) -> Path | None:
    """Ask every rank of a running trainstack job for its stacks and summary; fall back to py-spy through
    ``srun --overlap``. Returns the folder holding the dumps (None for the py-spy fallback)."""
    info = job_info(job_id)
    if info is None:
        raise JobError(f"Slurm does not know job {job_id} (finished long ago, or never existed). HINT: "
                       f"`trainstack status` lists your jobs.")
    running = [i.label for i in job_infos(job_id) if i.state == "RUNNING"]
    if "_" not in job_id and info.array_job_id is not None and len(running) > 1:
        raise JobError(f"job {job_id} is an array with {len(running)} running tasks; name one, e.g. "
                       f"`trainstack debug {running[0]}`.")
    if info.array_job_id is not None and "_" not in job_id and running:
        info = job_info(running[0]) or info
    if info.state != "RUNNING":
        raise JobError(f"job {job_id} is {info.state}, not RUNNING: there are no processes to inspect. HINT: a "
                       f"finished job's hang report (if any) is in its run folder, hang-*/SUMMARY.txt.")
    info.check_mine("debug")
    folder = job_folder(info)
    if folder is not None:
        ident = time.strftime("%Y%m%d-%H%M%S")
        (folder / f"debug-request-{ident}").write_text(f"pid {os.getpid()}\n")
        summary = folder / f"debug-{ident}" / "SUMMARY.txt"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not summary.exists():
            time.sleep(0.5)
        if summary.exists():
            echo(summary.read_text())
            return summary.parent
        echo(f"no answer from the job's watchdogs within {wait_s:.0f} s (not a trainstack program, or its main "
             f"thread holds the GIL); trying py-spy on every node.")
    _py_spy(info, echo)
    return None


def _py_spy(info: JobInfo, echo: Callable[[str], None]) -> None:
    script = (f"for pid in $(grep -l 'SLURM_JOB_ID={info.job_id}' /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); "
              f"do case \"$(tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null)\" in *python*) "
              f"echo \"=== $(hostname) pid $pid: $(tr '\\0' ' ' < /proc/$pid/cmdline | cut -c1-120)\"; "
              f"py-spy dump --pid $pid 2>&1 || echo '(py-spy not installed on this node: pip install py-spy)';; "
              f"esac; done")
    proc = subprocess.run(["srun", "--overlap", f"--jobid={info.job_id}", f"--nodes={info.num_nodes}",
                           "--ntasks-per-node=1", "bash", "-c", script], capture_output=True, text=True, timeout=120)
    echo(proc.stdout or proc.stderr)

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

from .errors import TrainstackError
from .render import safe_name

__all__ = ["JobError", "JobInfo", "job_info", "job_folder", "debug_job"]


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


def _field(text: str, name: str) -> str | None:
    m = re.search(rf"(?:^|\s){name}=(\S*)", text)
    return m.group(1) if m else None


def job_info(job_id: str) -> JobInfo | None:
    """What ``scontrol show job`` says (None when Slurm no longer knows the job)."""
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise JobError(f"{job_id!r} is not a Slurm job id (digits, or <array job>_<task> for an array task).")
    if shutil.which("scontrol") is None:
        raise JobError("scontrol not found on PATH. HINT: run this on a Slurm login node.")
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        raise JobError(f"scontrol could not answer: {proc.stderr.strip() or proc.stdout.strip()}")
    if "JobId=" not in proc.stdout:
        return None
    text = proc.stdout
    return JobInfo(job_id=job_id, name=_field(text, "JobName") or "", state=_field(text, "JobState") or "UNKNOWN",
                   nodes=_field(text, "NodeList") or "", num_nodes=int(_field(text, "NumNodes") or 0),
                   stdout=_field(text, "StdOut"), work_dir=_field(text, "WorkDir"),
                   elapsed=_field(text, "RunTime") or "", restarts=int(_field(text, "Restarts") or 0),
                   exit_code=_field(text, "ExitCode"))


def job_folder(info: JobInfo) -> Path | None:
    """``<log_dir>/<job name>-<job id>``: the log's folder holds the job folder of a trainstack script."""
    if not info.stdout:
        return None
    folder = Path(info.stdout).parent / f"{safe_name(info.name)}-{info.job_id}"
    return folder if folder.is_dir() else None


def debug_job(job_id: str, wait_s: float = 30.0, echo: Callable[[str], None] = print) -> Path | None:
    """Ask every rank of a running trainstack job for its stacks and summary; fall back to py-spy through
    ``srun --overlap``. Returns the folder holding the dumps (None for the py-spy fallback)."""
    info = job_info(job_id)
    if info is None:
        raise JobError(f"Slurm does not know job {job_id} (finished long ago, or never existed). HINT: "
                       f"`trainstack status` lists your jobs.")
    if info.state != "RUNNING":
        raise JobError(f"job {job_id} is {info.state}, not RUNNING: there are no processes to inspect. HINT: a "
                       f"finished job's hang report (if any) is in its run folder, hang-*/SUMMARY.txt.")
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

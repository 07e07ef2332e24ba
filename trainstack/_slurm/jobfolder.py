"""The job folder's layout, owned here: ``<log dir>/<safe job name>-<job id>/`` (``task-<i>/`` inside for an array
task), next to Slurm's combined log ``<log dir>/<job name>-<job id>.out``. Submitting, status, logs, cancel, debug
and the job script (through the render context) all ask this module. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["safe_name", "JobPaths"]


def safe_name(name: str) -> str:
    """A job name as a file name: what the job folder ``<log_dir>/<safe name>-<job id>`` is called."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60].strip("._") or "job"


@dataclass(frozen=True)
class JobPaths:
    """Where one job's files are. ``job_id`` is the job's (or the array's) id; ``task`` an array task index."""

    log_dir: Path
    job_name: str
    job_id: str
    task: int | None = None

    @staticmethod
    def prefix(log_dir: str | Path, job_name: str) -> str:
        """The folder name up to the job id (the job script appends ``$SLURM_JOB_ID`` itself)."""
        return f"{log_dir}/{safe_name(job_name)}-"

    @classmethod
    def of_log(cls, stdout: str, job_name: str, job_id: str, task: int | None = None) -> JobPaths:
        """The paths of a job Slurm describes by its output file (``StdOut``), which lies in the log folder."""
        return cls(Path(stdout).parent, job_name, job_id, task)

    @property
    def folder(self) -> Path:
        """The job folder (an array task's own folder inside it)."""
        base = self.log_dir / f"{safe_name(self.job_name)}-{self.job_id}"
        return base / f"task-{self.task}" if self.task is not None else base

    @property
    def job_folder(self) -> Path:
        """The job's (the whole array's) folder."""
        return self.log_dir / f"{safe_name(self.job_name)}-{self.job_id}"

    @property
    def log(self) -> Path:
        """Slurm's combined output (``%x-%j.out``, ``%x-%A_%a.out`` for an array task)."""
        suffix = f"{self.job_id}_{self.task}" if self.task is not None else self.job_id
        return self.log_dir / f"{self.job_name}-{suffix}.out"

    def task_paths(self, task: int) -> JobPaths:
        return JobPaths(self.log_dir, self.job_name, self.job_id, task)

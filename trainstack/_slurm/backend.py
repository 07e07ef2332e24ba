"""The Slurm backend (``_launch.backend.Backend``): the command line's verbs, answered by this room's modules --
sbatch and its test-only answer, squeue/scontrol/sacct and the job folders for status, the verdicts, the logs,
scancel, the debug dump, the free-memory step. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import LaunchSpec
    from .status import TaskStatus
    from .submission import SubmittedJob
    from .verdict import Verdict

__all__ = ["SlurmBackend"]


class SlurmBackend:
    """Slurm, for the command line."""

    name = "slurm"

    def check(self, spec: LaunchSpec) -> None:
        from .partition import check_submittable
        from .submission import sbatch_path

        sbatch_path()  # no Slurm here: that first, before what the job would find
        check_submittable(spec)

    def expected_start(self, script: str, spec: LaunchSpec) -> dict[str, Any]:
        from .submission import expected_start

        return expected_start(script, spec.partition, spec.world_size)

    def submit(self, spec: LaunchSpec, **options: Any) -> SubmittedJob:
        from .submission import submit_spec

        return submit_spec(spec, **options)

    def submission_lines(self, spec: LaunchSpec, job: SubmittedJob | None) -> list[str]:
        from .submission import finished_tasks, submission_notes, task_table

        if job is None:
            return [task_table(spec, finished_tasks(spec))] if spec.tasks else []
        return list(submission_notes(job))

    def find_submission(self, token: str) -> str | None:
        from .submission import find_submission

        return find_submission(token)

    def jobs(self, job_ids: Sequence[str], limit: int = 20) -> list[TaskStatus]:
        from .status import job_status, my_jobs

        return [row for job_id in job_ids for row in job_status(job_id)] if job_ids else my_jobs(limit)

    def table(self, rows: list[TaskStatus]) -> str:
        from .status import format_table

        return format_table(rows)

    def problem(self) -> str | None:
        from .status import slurm_problem

        return slurm_problem()

    def verdict(self, row: TaskStatus) -> Verdict:
        from .status import pending_note
        from .verdict import verdict

        found = verdict(row.state, row.folder, row.log)
        note = pending_note(row.job, row.folder) if row.state.startswith("PENDING") else None
        if note:
            found.kind, found.summary = "pending", note
        return found

    def exit_status(self, state: str) -> int:
        from .status import exit_status

        return exit_status(state)

    def log(self, job_id: str, rank: int | None = None) -> Path:
        from .status import find_log

        return find_log(job_id, rank)[0]

    def follow(self, job_id: str, rank: int | None, echo: Callable[[str], None], offset: int = 0) -> TaskStatus:
        from .status import follow_log

        return follow_log(job_id, rank, echo=echo, offset=offset)

    def wait(self, job_id: str, timeout: float | None = None) -> tuple[int, str]:
        from .status import wait_for

        return wait_for(job_id, None, timeout=timeout, cancel=False)

    def cancel(self, job_id: str) -> list[str]:
        from .status import cancel_job

        return cancel_job(job_id)

    def debug(self, job_id: str, wait_s: float, echo: Callable[[str], None]) -> Path | None:
        from .jobs import debug_job

        return debug_job(job_id, wait_s=wait_s, echo=echo)

    def free_memory(self, job_id: str, wait_s: int = 60) -> tuple[list[str], list[str]]:
        from .memoryfree import free_memory

        return free_memory(job_id, wait_s)

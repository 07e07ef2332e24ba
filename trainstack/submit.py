"""Write scripts and hand them to Slurm: ``submit_spec`` (a ``LaunchSpec`` as a job, with its job folder, metadata
and code snapshot), ``submit_function`` (a Python call as a job), ``wait_for``, ``expected_start``. The door to the
Slurm room's submitter (``trainstack/_slurm/submission.py``): the Slurm commands are spelled there."""

from __future__ import annotations

from ._common.modules import make_callable
from ._slurm.submission import (
    SUBMISSION_MARK,
    FunctionJob,
    SubmitError,
    SubmittedJob,
    expected_start,
    find_submission,
    finished_tasks,
    sbatch_path,
    submission_notes,
    submit,
    submit_function,
    submit_spec,
    task_table,
    wait_for,
    write_script,
)

__all__ = ["SubmitError", "SubmittedJob", "FunctionJob", "write_script", "submit", "submit_spec", "sbatch_path",
           "find_submission", "SUBMISSION_MARK",
           "submit_function", "finished_tasks", "wait_for", "expected_start", "task_table", "submission_notes"]

make_callable(__name__, submit)  # ``from trainstack import submit`` calls it, whatever was imported first

"""The job folder's layout has one owner: submit, status, logs, cancel and the job script agree on it."""

from __future__ import annotations

from pathlib import Path

from trainstack._slurm.jobfolder import JobPaths, safe_name
from trainstack.render import LaunchSpec, render


def test_paths_of_a_job_and_of_an_array_task():
    job = JobPaths(Path("/s/logs"), "my run; rm -rf", "42")
    assert job.folder == Path("/s/logs/my_run_rm_-rf-42") and job.log == Path("/s/logs/my run; rm -rf-42.out")
    task = job.task_paths(3)
    assert task.folder == job.folder / "task-3" and task.job_folder == job.folder
    assert task.log == Path("/s/logs/my run; rm -rf-42_3.out")  # Slurm's %x-%A_%a.out
    assert JobPaths.of_log("/s/logs/x-42.out", "x", "42").folder == Path("/s/logs/x-42")
    assert safe_name("..") == "job" and len(safe_name("a" * 100)) == 60


def test_the_job_script_builds_the_same_folder():
    spec = LaunchSpec(program=["t.py"], log_dir="/s/logs", job_name="my run")
    assert f"JOB_DIR={JobPaths.prefix('/s/logs', 'my run')}" in render(spec).replace("'", "")

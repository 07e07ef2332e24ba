"""Preemption on the real 2-node Slurm: signal -> checkpoint -> requeue -> resume -> the reference result."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ci_leaves_out

from trainstack.render import LaunchSpec
from trainstack.submit import submit_spec, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(400)]
PROBE = str(Path(__file__).with_name("_requeue_train.py"))


def _spec(out: Path, launcher: str) -> LaunchSpec:
    return LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=1, launcher=launcher, time="10",
                      job_name="trainstack-test", log_dir=str(out / "logs"), requeue=True, max_requeues=1,
                      node_check=False,  # counted requeues: a node left out by a check would add one
                      env={"PROBE_OUT": str(out)}, venv=str(Path(sys.executable).parents[1]), program=[PROBE])


def _why(env, job_id):
    out = subprocess.run([sys.executable, "-m", "trainstack", "why", "--json", job_id], env=env, capture_output=True,
                         text=True, timeout=60)
    return json.loads(out.stdout)


def _job_field(env, job_id, name):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else None


def _wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# torchrun: the signal goes through its agent to the workers; srun's direct path requeues in the two tests below
@ci_leaves_out("a signalled requeue on real Slurm: the graceful-stop test below; bitwise after a requeue: "
               "test_across_clusters.py's move")
@pytest.mark.parametrize("launcher", ["torchrun"])
def test_signal_checkpoint_requeue_resume(slurm_env, shared_tmp, monkeypatch, launcher):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    ref_dir, run_dir = shared_tmp / "ref", shared_tmp / "run"
    ref_dir.mkdir(mode=0o777)
    run_dir.mkdir(mode=0o777)
    ref = submit_spec(_spec(ref_dir, launcher), wait=True, timeout=200)
    assert ref.exit_code == 0, ref.log_path.read_text()

    job = submit_spec(_spec(run_dir, launcher))
    _wait_until(lambda: (run_dir / "epochs").exists() and int((run_dir / "epochs").read_text() or 0) >= 2, 120,
                "two epochs")
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], env=slurm_env, check=True)
    _wait_until(lambda: _job_field(slurm_env, job.job_id, "Restarts") == "1", 120, "the requeue")
    _wait_until(lambda: _job_field(slurm_env, job.job_id, "JobState") != "COMPLETING", 60, "the requeue's end")
    before = _job_field(slurm_env, job.job_id, "Reason")  # Slurm sets Restarts=1 while the attempt still completes
    held = subprocess.run([sys.executable, "-m", "trainstack", "why", job.job_id], env=slurm_env, capture_output=True,
                          text=True, timeout=60).stdout
    if before == _job_field(slurm_env, job.job_id, "Reason") == "BeginTime":  # held throughout: why says so
        assert "requeued (restart 1) after time limit: graceful stop at step" in held and "holds it until" in held, held
    assert wait_for(job, timeout=300) == 0, job.log_path.read_text()  # following the job releases the hold
    log = job.log_path.read_text()
    starts = [line.split() for line in (run_dir / "starts").read_text().splitlines()]
    print(f"{launcher}: signal -> training resumed {float(starts[1][0]) - signalled:.1f}s (the hold released "
          f"by the follower), resumed at step {starts[1][1]}")
    assert "without its hold" in log, log
    assert "received" not in log or "SIGUSR1 at" in log
    assert "requeueing job" in log and "restart 1 at" in log and "finished (restart count 1)" in log
    assert "Graceful stop at epoch" in log and "Resumed from" in log and starts[1][2] == "1"
    assert 0 < int(starts[1][1]) < 240
    expected = torch.load(ref_dir / "final.pt", weights_only=True)
    got = torch.load(run_dir / "final.pt", weights_only=True)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_a_graceful_stop_signalled_to_the_steps_requeues_as_a_time_limit(slurm_env, shared_tmp, monkeypatch):
    """`--signal USR2@60` without `B:` (or scancel --signal to the steps) reaches the trainer, not the batch trap:
    the trainer still checkpoints and confirms it, and the script must count that as a time limit, not a crash."""
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    run_dir = shared_tmp / "steps"
    run_dir.mkdir(mode=0o777)
    job = submit_spec(_spec(run_dir, "srun"))
    _wait_until(lambda: (run_dir / "epochs").exists() and int((run_dir / "epochs").read_text() or 0) >= 2, 120,
                "two epochs")
    subprocess.run(["scancel", "--signal=USR2", job.job_id], env=slurm_env, check=True)  # the steps, no trap
    _wait_until(lambda: _job_field(slurm_env, job.job_id, "Restarts") == "1", 120, "the requeue")
    assert wait_for(job, timeout=200) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "timeout (exit status 0): requeueing" in log and "crash" not in log and "giving up" not in log
    assert "finished (restart count 1)" in log
    rows = [json.loads(line) for line in (job.job_dir / "verdicts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["kind"], r["retried"]) for r in rows] == [(0, "time limit", True)], rows
    assert _why(slurm_env, job.job_id)["kind"] == "completed"


def test_a_signal_without_requeue_stops_gracefully_instead_of_killing_the_job(slurm_env, shared_tmp, monkeypatch):
    """`--signal B:USR2@T` without `--requeue`: bash's default action for USR2 would end the batch shell (and the
    steps) at once, without a checkpoint; the trap asks the trainer to checkpoint, then the job ends cleanly."""
    import dataclasses

    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    run_dir = shared_tmp / "signal-only"
    run_dir.mkdir(mode=0o777)
    spec = dataclasses.replace(_spec(run_dir, "srun"), requeue=False, signal="B:USR2@60")
    job = submit_spec(spec)
    _wait_until(lambda: (run_dir / "epochs").exists() and int((run_dir / "epochs").read_text() or 0) >= 2, 120,
                "two epochs")
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], env=slurm_env, check=True)
    assert wait_for(job, timeout=200) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "Graceful stop at epoch" in log and "not requeued (no --requeue)" in log, log
    found = _why(slurm_env, job.job_id)
    assert found["kind"] == "time limit" and "not requeued" in found["summary"], found
    assert list((run_dir).glob("slurm-*/checkpoints/ckpt-*.pt"))


@ci_leaves_out("the script's words: tests/test_render.py")
def test_torchrun_without_signal_handling_still_runs_the_requeue_script(slurm_env, shared_tmp, monkeypatch):
    """An image whose torch predates --signals-to-handle (an old torch) must not die at start: the script asks the
    image first. Stood in for by an interpreter that answers like an old torch to that one question."""
    import dataclasses

    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    run_dir = shared_tmp / "old-torch"
    run_dir.mkdir(mode=0o777)
    shim = run_dir / "python-old-torch"
    shim.write_text(f"#!/bin/bash\n# answers the script's torchrun question like torch < 2.9 would\n"
                    f"if [[ \"$*\" == *signals-to-handle* ]]; then\n  {sys.executable} -c 'print(\"python 3 torch "
                    f"2.8.0 cuda None nccl None\"); print(\"torchrun-signals\", False)'\n  exit 0\nfi\n"
                    f"exec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    spec = dataclasses.replace(_spec(run_dir, "torchrun"), python=str(shim), max_requeues=0)
    job = submit_spec(spec, wait=True, timeout=200)
    log = job.log_path.read_text()
    assert job.exit_code == 0, log
    assert "this torchrun has no --signals-to-handle" in log and "finished (restart count 0)" in log


@ci_leaves_out("the decision: tests/test_allocation.py; a signalled requeue on real Slurm: the graceful-stop test")
def test_a_requeue_after_fit_returned_is_that_stop_not_a_crash(slurm_env, shared_tmp, monkeypatch):
    """`scontrol requeue` while the script runs its own code after fit(): the attempt is booked as the preemption it
    is (no retry spent), and the requeued attempt has nothing left to train before that code runs again."""
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    run_dir = shared_tmp / "after-fit"
    run_dir.mkdir(mode=0o777)
    spec = _spec(run_dir, "srun")
    job = submit_spec(LaunchSpec(**{**spec.__dict__, "env": {**spec.env, "AFTER_FIT_SLEEP": "30"}}))
    _wait_until(lambda: (run_dir / "fit-done").exists(), 150, "the end of fit()")
    subprocess.run(["scontrol", "requeue", job.job_id], env=slurm_env, check=True)
    _wait_until(lambda: _job_field(slurm_env, job.job_id, "Restarts") == "1", 120, "the requeue")
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    rows = [json.loads(line) for line in (job.job_dir / "verdicts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["kind"], r["retried"]) for r in rows] == [(0, "preempted", True)], rows
    assert "crash" not in log and "NOTHING TO TRAIN" in log and (run_dir / "after-fit-1").exists(), log[-3000:]

"""Verdicts on the real 2-node Slurm: each fault program's job ends with the right verdict in `trainstack status`
and `trainstack why` (a Python error names the first failing rank, not the ranks killed after it)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from test_workflow import JOB, env, job_id_of, ts, wait_ended  # noqa: F401  (env is a fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]
FAULT = Path(__file__).with_name("_fault.py")


def test_each_fault_gets_its_verdict(env, shared_tmp):  # noqa: F811
    work = shared_tmp / "faults"
    work.mkdir()
    shutil.copy(FAULT, work / "_fault.py")
    jobs = {}
    for kind in ("error", "oom", "kill9", "fine", "sleep"):
        out = ts(env, "submit", "--cpu", "--setup", "multi-node", "--nodes", "2", "--procs-per-node", "2",
                 "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs"), "--no-snapshot", "--",
                 "_fault.py", kind, cwd=work)
        jobs[kind] = job_id_of(out.stdout)
    deadline = time.monotonic() + 120
    while "RUNNING" not in ts(env, "status", jobs["sleep"]).stdout and time.monotonic() < deadline:
        time.sleep(1)
    ts(env, "cancel", jobs["sleep"])
    wait_ended(env, list(jobs.values()))
    found = {kind: json.loads(ts(env, "why", "--json", job).stdout) for kind, job in jobs.items()}
    report = json.dumps(found, indent=1)
    assert found["error"]["kind"] == "python error" and found["error"]["rank"] == 1, report
    assert "ZeroDivisionError" in found["error"]["summary"] and "_fault.py:" in found["error"]["summary"], report
    assert found["oom"]["kind"] == "cuda out-of-memory" and found["oom"]["rank"] == 1, report
    assert found["kill9"]["kind"] == "killed (signal 9)", report
    assert found["fine"]["kind"] == "completed", report
    assert found["sleep"]["kind"] == "cancelled", report
    status = ts(env, "status", jobs["error"]).stdout
    assert f"{jobs['error']}: python error: ZeroDivisionError" in status, status
    why = ts(env, "why", jobs["oom"]).stdout
    assert "HINT:" in why and "accumulation" in why, why


def _requeued(job_env, work, program, *args):
    """Submit ``program`` from ``work`` as a requeueing CPU job, as a user would; its job id."""
    out = ts(job_env, "submit", "--cpu", "--time", "5", "--requeue", "--signal", "B:USR2@30", "--max-requeues", "3",
             "--job-name", JOB, "--log-dir", str(work / "logs"), "--no-snapshot", "--", program, *args, cwd=work)
    return job_id_of(out.stdout)


@pytest.mark.slow
def test_a_deterministic_failure_is_retried_once_then_stopped_a_transient_one_completes(env, shared_tmp):  # noqa: F811
    work = shared_tmp / "retries"
    work.mkdir()
    shutil.copy(FAULT.with_name("_flaky.py"), work / "_flaky.py")
    jobs = {kind: _requeued(env, work, "_flaky.py", kind) for kind in ("deterministic", "transient")}
    rows = wait_ended(env, list(jobs.values()), timeout=360)
    assert rows[jobs["transient"]][0]["state"].startswith("COMPLETED"), rows
    assert rows[jobs["deterministic"]][0]["state"].startswith("FAILED"), rows
    log = ts(env, "logs", jobs["deterministic"]).stdout
    assert "not retried: python error: ZeroDivisionError: a bug that fails the same way every time" in log, log
    assert "same as attempt 0, no progress" in log, log
    folder = next((work / "logs").glob(f"*-{jobs['deterministic']}"))
    attempts = [json.loads(line) for line in (folder / "verdicts.jsonl").read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == [0, 1], attempts
    listed = ts(env, "status", "--attempts", jobs["deterministic"]).stdout
    assert "attempt 0: python error" in listed and "attempt 1: python error" in listed, listed


@pytest.mark.slow
def test_a_host_fault_leaves_the_host_out_of_the_requeued_attempt(env, shared_tmp):  # noqa: F811
    work = shared_tmp / "hostfault"
    work.mkdir()
    shutil.copy(FAULT.with_name("_gpu_fault.py"), work / "_gpu_fault.py")
    job = _requeued(env, work, "_gpu_fault.py", str(work))
    rows = wait_ended(env, [job], timeout=360)
    log = ts(env, "logs", job).stdout
    assert rows[job][0]["state"].startswith("COMPLETED"), (rows, log)
    hosts = dict(line.split() for line in (work / "hosts").read_text().splitlines())
    assert set(hosts) == {"0", "1"} and hosts["0"] != hosts["1"], (hosts, log)
    assert f"the requeued attempt leaves out {hosts['0']}" in log, log
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                           timeout=30).stdout
    assert f"ExcNodeList={hosts['0']}" in shown, shown

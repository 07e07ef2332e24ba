"""Hang forensics on the real 2-node Slurm: a stuck rank is named and the job ends instead of hanging; and
`trainstack debug` shows every rank's stacks of a live job without stopping it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainstack.cli import main
from trainstack.render import LaunchSpec
from trainstack.submit import submit_spec, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
JOB = str(Path(__file__).with_name("_hang_job.py"))
VENV = str(Path(sys.executable).parents[1])


def _spec(out: Path, mode: str, timeout: str) -> LaunchSpec:
    return LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, launcher="srun", time="10",
                      job_name="trainstack-test", log_dir=str(out / "logs"), venv=VENV, program=[JOB],
                      env={"PROBE_OUT": str(out), "MODE": mode, "TRAINSTACK_HANG_TIMEOUT": timeout})


def test_a_stuck_rank_is_named_and_the_job_ends(slurm_env, shared_tmp, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    job = submit_spec(_spec(shared_tmp, "stuck", "5"))
    code = wait_for(job, timeout=200)
    log = job.log_path.read_text()
    assert code != 0, log
    print(f"stuck rank -> job ended in {time.monotonic() - start:.1f}s")
    [folder] = list((shared_tmp / "run").glob("hang-*"))
    assert sorted(p.name for p in folder.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(4)]
    summary = (folder / "SUMMARY.txt").read_text()
    assert "rank 1 (node1" in summary and "stuck_in_user_code" in summary, summary
    assert "trainstack hang report" in log
    why = subprocess.run([sys.executable, "-m", "trainstack", "why", "--json", job.job_id], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ))
    found = json.loads(why.stdout)  # the report sits in the run folder, outside the job folder: read from the logs
    assert found["kind"] == "hang" and found["summary"].startswith("rank 1 (node1"), found


def _ranks_named(report: str) -> set[int]:
    """Every rank a report line names ("rank 3 (...)", "ranks 0, 2 are ...", "ranks 0-3 are ...")."""
    named: set[int] = set()
    for match in re.finditer(r"^ranks? ([0-9][0-9, \-]*)", report, re.MULTILINE):
        for part in match.group(1).replace(" ", "").strip(",").split(","):
            if "-" in part:
                lo, hi = part.split("-")
                named.update(range(int(lo), int(hi) + 1))
            elif part:
                named.add(int(part))
    return named


def test_debug_shows_every_rank_of_a_live_job(slurm_env, shared_tmp, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    job = submit_spec(_spec(shared_tmp, "slow", "0"))  # the watchdog only answers requests here
    try:
        deadline = time.monotonic() + 120
        while not (shared_tmp / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (shared_tmp / "started").exists(), job.log_path.read_text()
        result = CliRunner().invoke(main, ["debug", job.job_id, "--wait", "60"])
        assert result.exit_code == 0, result.output
        assert "trainstack debug report" in result.output and "4 rank(s)" in result.output
        assert _ranks_named(result.output) == {0, 1, 2, 3}, result.output
        [folder] = [p for p in (shared_tmp / "logs").glob(f"trainstack-test-{job.job_id}/debug-*") if p.is_dir()]
        assert sorted(p.name for p in folder.glob("rank-*.txt")) == [f"rank-{r}.txt" for r in range(4)]
        state = subprocess.run(["scontrol", "show", "job", "-o", job.job_id], env=slurm_env, capture_output=True,
                               text=True).stdout
        assert "JobState=RUNNING" in state  # looking did not stop it
    finally:
        subprocess.run(["scancel", job.job_id], env=slurm_env, timeout=30)

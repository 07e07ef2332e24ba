"""doctor inside a real Slurm step (with the environment wiped as --cleanenv does) and nccl-check via a script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainstack.cli import main

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]


def test_doctor_detects_a_wiped_slurm_environment(slurm_env):
    base = ["srun", "--job-name=trainstack-test", "--time=2", "--nodes=1", "--ntasks=1"]
    ok = subprocess.run([*base, sys.executable, "-m", "trainstack", "doctor"], env=slurm_env, capture_output=True,
                        text=True, timeout=120)
    assert "--cleanenv" not in ok.stdout and "slurm: rank=0 world_size=1" in ok.stdout, ok.stdout + ok.stderr
    wiped = subprocess.run([*base, "env", "-i", "PATH=/usr/bin:/bin", sys.executable, "-m", "trainstack", "doctor"],
                           env=slurm_env, capture_output=True, text=True, timeout=120)
    assert wiped.returncode != 0 and "every SLURM_* variable is missing" in wiped.stdout, wiped.stdout


def test_nccl_check_through_the_generated_multinode_script(slurm_env, shared_tmp, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    result = CliRunner().invoke(main, ["submit", "--setup", "multi-node", "--nodes", "2", "--cpu", "--launcher",
                                       "torchrun", "--job-name", "trainstack-test", "--time", "5", "--log-dir",
                                       str(shared_tmp), "--venv", str(Path(sys.executable).parents[1]), "--wait",
                                       "--", "-m", "trainstack.nccl_check", "--megabytes", "8"])
    log = "".join(p.read_text() for p in shared_tmp.glob("*.out"))
    assert result.exit_code == 0, result.output + log
    assert "nccl-check PASSED: world 4" in log and log.count("all_reduce ok") == 4

"""nntool's slurm_fn/SlurmConfig on the real 2-node Slurm: seed 004's main.py with only the imports changed, its
distributed_launch_command (accelerate launch with the placeholders) on 2 nodes, and a plain function's result."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainstack.slurm import SlurmConfig, slurm_fn

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
HERE = Path(__file__).parent
MAIN = HERE / "_nntool_main.py"


@slurm_fn
def cube(x):
    return x ** 3


def test_seed_004_distributed_launch_command_runs_on_two_nodes(slurm_env, shared_tmp):
    accelerate = Path(sys.executable).parent / "accelerate"  # the venv's (the job's PATH may not hold it)
    command = (f"{accelerate} launch --cpu --num_processes {{num_processes}} --num_machines {{num_machines}} "
               f"--machine_rank {{machine_rank}} --main_process_ip {{main_process_ip}} --main_process_port "
               f"{{main_process_port}} {MAIN} {shared_tmp} unused")
    out = subprocess.run([sys.executable, str(MAIN), str(shared_tmp), command], env=slurm_env, capture_output=True,
                         text=True, timeout=60, cwd=shared_tmp)
    assert out.returncode == 0 and "JOB " in out.stdout, out.stdout + out.stderr
    job = out.stdout.split("JOB ", 1)[1].split()[0]
    deadline = time.monotonic() + 240
    while len(list(shared_tmp.glob("rank*"))) < 2 and time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if not state:  # the job ended
            break
        time.sleep(1)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in shared_tmp.rglob("*.out"))
    assert sorted(p.name for p in shared_tmp.glob("rank*")) == ["rank0", "rank1"], logs
    assert (shared_tmp / "rank0").read_text() == "2 4", logs  # 2 processes (one per node), 64/8/2 batches each


def test_a_plain_slurm_fn_call_returns_its_result(slurm_env, shared_tmp, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", str(HERE.parent.parent) + ":" + str(HERE))
    config = SlurmConfig(mode="slurm", job_name="trainstack-test", output_parent_path=str(shared_tmp), timeout_min=5)
    job = cube[config](3)
    assert job.result(timeout=150) == 27 and job.job_id

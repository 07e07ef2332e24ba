"""Generated scripts submitted to the real local 2-node Slurm with the CLI, checked rank by rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import ci_leaves_out

from trainstack.cli import main
from trainstack.render import LaunchSpec, render

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
PROBE = str(Path(__file__).with_name("_probe_train.py"))
VENV = str(Path(sys.executable).parents[1])


def _submit(slurm_env, monkeypatch, tmp, *args, program=(PROBE,), job_name="trainstack-test"):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PROBE_OUT", str(tmp))
    start = time.monotonic()
    result = CliRunner().invoke(main, ["submit", "--cpu", "--time", "5", "--log-dir", str(tmp / "logs"),
                                       "--job-name", job_name, "--venv", VENV, "--wait", *args, "--", *program],
                                catch_exceptions=False)
    elapsed = time.monotonic() - start
    logs = "".join(p.read_text() for p in (tmp / "logs").glob("*.out"))
    records = [json.loads(p.read_text()) for p in sorted(tmp.glob("rank*.json"))]
    return result, records, logs, elapsed


ONE_NODE = ci_leaves_out("each launcher trains on two nodes here; every setup's script is rendered and checked in "
                         "tests/test_render.py")

OTHER_LAUNCHER = ci_leaves_out("srun trains on two nodes here; each launcher's script runs in "
                               "tests/slurm/test_workflow.py's plain sbatch of every generated variant")


@pytest.mark.parametrize("setup, launcher, nodes, procs", [
    ("single-gpu", "srun", 1, 1), pytest.param("single-gpu", "torchrun", 1, 1, marks=ONE_NODE),
    pytest.param("multi-gpu", "srun", 1, 2, marks=ONE_NODE),
    pytest.param("multi-gpu", "torchrun", 1, 2, marks=ONE_NODE),
    ("multi-node", "srun", 2, 2), pytest.param("multi-node", "torchrun", 2, 2, marks=OTHER_LAUNCHER),
    pytest.param("multi-node", "spawn", 2, 2, marks=OTHER_LAUNCHER),
])
def test_generated_script_trains_on_the_right_ranks(slurm_env, shared_tmp, monkeypatch, setup, launcher, nodes, procs):
    world = nodes * procs
    args = ["--setup", setup, "--launcher", launcher, "--nodes", str(nodes), "--procs-per-node", str(procs)]
    result, records, logs, elapsed = _submit(slurm_env, monkeypatch, shared_tmp, *args, program=(PROBE, str(world)))
    print(f"{setup}/{launcher}: {elapsed:.1f}s")
    assert result.exit_code == 0, result.output + logs
    assert sorted(r["rank"] for r in records) == list(range(world)), logs
    assert all(r["world"] == world and r["epoch"] == 2 for r in records)
    assert len({round(r["param_sum"], 6) for r in records}) == 1  # one model, trained together
    assert len({r["node"] for r in records}) == nodes
    assert "=== trainstack job" in logs and "torch 2." in logs


def test_hostile_values_stay_literal_in_the_running_job(slurm_env, shared_tmp, monkeypatch):
    marker = shared_tmp / "pwned"
    evil = f"$(touch {marker})"
    result, records, logs, _ = _submit(slurm_env, monkeypatch, shared_tmp, "--env", f"NOTE=a b {evil} `id`",
                                       program=(PROBE, "x; rm -rf ~", evil, "it's"), job_name="x; rm -rf ~")
    assert result.exit_code == 0, result.output + logs
    assert records[0]["argv"] == ["x; rm -rf ~", evil, "it's"]
    assert records[0]["note"] == f"a b {evil} `id`"
    assert not marker.exists()
    job_id = re.search(r"^job (\d+) ", result.output, re.M).group(1)
    out = subprocess.run(["scontrol", "show", "job", job_id], env=slurm_env, capture_output=True, text=True).stdout
    assert "JobName=x; rm -rf ~" in out


def test_failing_program_fails_the_job(slurm_env, shared_tmp, monkeypatch):
    result, _, logs, _ = _submit(slurm_env, monkeypatch, shared_tmp, "--setup", "multi-node", "--nodes", "2",
                                 "--launcher", "srun", program=("/no/such/program.py",))
    assert result.exit_code != 0 and "/no/such/program.py" in result.output  # refused before sbatch


def test_sbatch_test_only_accepts_and_rejects_like_slurm(slurm_env, shared_tmp):
    ok = shared_tmp / "ok.sbatch"
    ok.write_text(render(LaunchSpec(setup="multi-node", nodes=2, cpu=True, program=["t.py"], log_dir=str(shared_tmp))))
    bad = shared_tmp / "bad.sbatch"
    bad.write_text(render(LaunchSpec(setup="multi-node", nodes=3, cpu=True, program=["t.py"], log_dir=str(shared_tmp))))
    good = subprocess.run(["sbatch", "--test-only", str(ok)], env=slurm_env, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    rejected = subprocess.run(["sbatch", "--test-only", str(bad)], env=slurm_env, capture_output=True, text=True)
    assert rejected.returncode != 0 and "node configuration is not available" in rejected.stderr


@pytest.mark.timeout(300)
@ci_leaves_out("a generated two-node srun script trains in test_generated_script_trains_on_the_right_ranks; "
               "nprocs yielding to the launcher's processes: tests/distributed/test_examples.py under torchrun")
@pytest.mark.parametrize("launcher", ["srun", "spawn"])
def test_the_cli_epilog_example_runs_as_typed(slurm_env, shared_tmp, launcher):
    """`trainstack generate --setup multi-node --nodes 2 --cpu --procs-per-node 2 -o job.sbatch -- examples/demo.py`
    then plain sbatch: the demo's own --nprocs default (2) must not fight the 4 processes the job was given."""
    import os

    repo = Path(__file__).resolve().parents[2]
    env = {**slurm_env, "PYTHONPATH": str(repo), "PATH": f"{Path(sys.executable).parent}:{slurm_env['PATH']}"}
    script = shared_tmp / "job.sbatch"
    gen = subprocess.run([sys.executable, "-m", "trainstack", "generate", "--setup", "multi-node", "--nodes", "2",
                          "--cpu", "--procs-per-node", "2", "--launcher", launcher, "--job-name", "trainstack-test",
                          "--time", "5", "--log-dir", str(shared_tmp / "logs"), "-o", str(script), "--",
                          str(repo / "examples" / "demo.py"), "--epochs", "2"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=shared_tmp)
    assert gen.returncode == 0, gen.stderr
    job = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], env=env, capture_output=True, text=True,
                         timeout=240, cwd=shared_tmp)
    log = next((shared_tmp / "logs").glob("trainstack-test-*.out")).read_text()
    assert job.returncode == 0, log
    assert "training on 4 process(es)" in log and "final loss" in log, log
    assert launcher == "srun" or "nprocs=2 ignored: this job was allocated 4 processes" in log
    assert os.path.exists(shared_tmp / "logs")

"""One run across two clusters, for real (issue 55): the local Slurm ("alpha") and a second, independent Slurm
("beta": its own ClusterName, slurmctld, nodes and state), one S3-compatible store (moto's server on 127.0.0.1)
they both reach. The follower (`trainstack submit --cluster alpha.toml --cluster beta.toml --store URL`) places the
run on alpha; alpha's partition goes down and the job is preempted (requeued there, so it waits); the follower moves
the run to beta, which resumes from the store -- and the run ends with the same parameters and the same losses as a
run that never moved, one run id, one lineage in the store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import ROOT, moto_s3

from trainstack import _lease

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]
PROGRAM = "tests/slurm/_across_train.py"
BETA = Path("/tmp/trainstack-slurm-beta/slurm.conf")


@pytest.fixture(scope="module")
def beta(slurm_env):
    """The second cluster, up for this module (scripts/slurm-local.sh with TRAINSTACK_SLURM_CLUSTER=beta)."""
    env = {**os.environ, "TRAINSTACK_SLURM_CLUSTER": "beta"}
    env.pop("SLURM_CONF", None)
    subprocess.run([str(ROOT / "scripts/slurm-local.sh"), "up"], env=env, check=True, timeout=180,
                   capture_output=True)
    try:
        yield str(BETA)
    finally:
        subprocess.run([str(ROOT / "scripts/slurm-local.sh"), "down"], env=env, timeout=120, capture_output=True)


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as (env, _):
        yield env


def _profile(path: Path, name: str, conf: str) -> str:
    path.write_text(f'cluster = "{name}"\nslurm_conf = "{conf}"\n')
    return str(path)


def _final(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final.pt")


def _losses(run: Path) -> dict[int, float]:
    """Every step's loss (and each epoch's mean, at its last step) as metrics.jsonl has them."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in ("loss", "train_loss"):
            if key in row:
                out[(int(row["step"]), key)] = row[key]
    return out


def _first_time(run: Path) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["time"]


def test_a_preempted_run_moves_to_the_other_cluster_and_ends_as_if_it_never_moved(slurm_env, beta, s3, shared_tmp,
                                                                                    monkeypatch):
    import s3fs

    env = {**slurm_env, **s3, "PYTHONPATH": str(ROOT)}
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    bucket = f"ts-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    alpha_profile = _profile(shared_tmp / "alpha.toml", "alpha", slurm_env["SLURM_CONF"])
    beta_profile = _profile(shared_tmp / "beta.toml", "beta", beta)
    job = ["--setup", "multi-gpu", "--cpu", "--procs-per-node", "2", "--job-name", "trainstack-test",
           "--time", "00:10:00", "--log-dir", str(shared_tmp / "logs"), "--no-snapshot"]

    # the run that never moves: alpha alone, the same world size
    ref_root = shared_tmp / "ref"
    ref = subprocess.run([sys.executable, "-m", "trainstack", "submit", "--profile", alpha_profile, *job, "--wait",
                          "--env", f"OUT_ROOT={ref_root}", "--env", "TRAINSTACK_CLUSTER=alpha",
                          "--env", f"TRAINSTACK_CHECKPOINT_STORE=s3://{bucket}/ref", "--", PROGRAM],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    moved_root = shared_tmp / "moved"
    url = f"s3://{bucket}/moved"
    follower = subprocess.Popen(
        [sys.executable, "-m", "trainstack", "submit", "--cluster", alpha_profile, "--cluster", beta_profile,
         "--store", url, "--move-cost", "30", *job, "--env", f"OUT_ROOT={moved_root}", "--env", "STEP_SLEEP=0.4",
         "--", PROGRAM], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    said: list[str] = []
    alpha_env = {**env, "SLURM_CONF": slurm_env["SLURM_CONF"]}
    try:
        from trainstack._checkpoint.store import Store

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(step >= 6 for (step, _), _ in Store(url).committed()):
            time.sleep(0.5)
        assert any(step >= 6 for (step, _), _ in Store(url).committed()), "alpha committed nothing to the store"
        # preempt on alpha: its partition goes down and the job is requeued there, so it waits
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=DOWN"], env=alpha_env, check=True)
        jobs = subprocess.run(["squeue", "-h", "-n", "trainstack-test", "-o", "%i"], env=alpha_env,
                              capture_output=True, text=True).stdout.split()
        assert jobs, "the run's job is not on alpha"
        subprocess.run(["scontrol", "requeue", jobs[0]], env=alpha_env, check=True)
        preempted = time.time()
        out, _ = follower.communicate(timeout=360)
        said = out.splitlines()
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], env=alpha_env)
        if follower.poll() is None:
            os.killpg(follower.pid, 9)
            follower.wait()
    text = "\n".join(said)
    assert follower.returncode == 0, text[-4000:]
    assert re.search(r"run on alpha: job \d+ \(first placement", text), text
    assert "waits on alpha" in text and "moving" in text and re.search(r"run on beta: job \d+", text), text
    assert "the run completed on beta" in text, text

    # the same parameters and losses as the run that never moved
    mine, theirs = _final(moved_root / "beta"), _final(ref_root / "alpha")
    assert [k for k in theirs if not torch.equal(mine[k], theirs[k])] == []
    ref_losses, beta_losses = _losses(ref_root / "alpha" / "run"), _losses(moved_root / "beta" / "run")
    alpha_losses = _losses(moved_root / "alpha" / "run")
    resumed = min(step for step, _ in beta_losses)
    assert resumed > 1 and max(beta_losses) == max(ref_losses) and len(ref_losses) == 24 + 2
    assert {k: v for k, v in ref_losses.items() if k[0] >= resumed} == beta_losses
    assert {k: v for k, v in ref_losses.items() if k[0] < resumed} == {k: v for k, v in alpha_losses.items()
                                                                       if k[0] < resumed}
    move_s = _first_time(moved_root / "beta" / "run") - preempted
    print(f"\nmoved: preempted on alpha -> first resumed step (step {resumed}) on beta in {move_s:.1f} s")
    assert move_s < 120
    # one run: the same run id on both clusters, one lineage in the store, the attempts named
    ids = {json.loads((moved_root / c / "run" / "run.json").read_text())["run_id"] for c in ("alpha", "beta")}
    assert len(ids) == 1
    lines = _lease.describe(url)
    assert "the writer now is epoch 2 (beta" in lines[0]
    assert "epoch 1: alpha" in lines[1] and "epoch 2: beta" in lines[2] and "bitwise equality held" in lines[2]

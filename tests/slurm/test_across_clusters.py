"""One run across two clusters, for real (issue 55): two independent local Slurm clusters of this module's own
("alpha" and "beta", each with its own ClusterName, slurmctld, ports, nodes and state: scripts/slurm-local.sh with
TRAINSTACK_SLURM_CLUSTER; the project's main local Slurm is not touched, so this module runs beside the Slurm tests),
one S3-compatible store (moto's server on 127.0.0.1) they both reach; each cluster named by a profile and reached
from this machine (slurm_conf) or, in the last test, through its own sshd and Unix account, as from a laptop. The
follower (`trainstack submit --cluster alpha.toml --cluster beta.toml --store URL`) places the run on alpha; alpha's
partition goes down and the job is preempted (requeued there, so it waits); the follower moves the run to beta, which
resumes from the store -- and the run ends with the same parameters and the same losses as a run that never moved,
one run id, one lineage in the store."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from _sshd import VENV, account, keys, remote_install, sshd
from helpers import ROOT, ci_leaves_out, moto_s3

from trainstack._common import lease as _lease

pytestmark = [pytest.mark.slow, pytest.mark.own_clusters, pytest.mark.timeout(600)]
PROGRAM = "tests/slurm/_across_train.py"


@pytest.fixture(scope="module")
def slurms():
    """alpha's and beta's slurm.conf, both clusters up for this module and down after it."""
    if not shutil.which("slurmctld") or os.geteuid() != 0:
        message = "needs root and Slurm (apt-get install slurm-wlm munge)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    envs = {name: {**os.environ, "TRAINSTACK_SLURM_CLUSTER": name} for name in ("alpha", "beta")}
    try:
        for env in envs.values():
            env.pop("SLURM_CONF", None)
            subprocess.run([str(ROOT / "scripts/slurm-local.sh"), "up"], env=env, check=True, timeout=180,
                           capture_output=True)
        yield {name: f"/tmp/trainstack-slurm-{name}/slurm.conf" for name in envs}
    finally:
        for env in envs.values():
            subprocess.run([str(ROOT / "scripts/slurm-local.sh"), "down"], env=env, timeout=120, capture_output=True)


@pytest.fixture
def slurm_env(slurms):
    """The environment of a user on alpha (what the module's tests start from)."""
    return {**os.environ, "SLURM_CONF": slurms["alpha"]}


@pytest.fixture
def beta(slurms):
    return slurms["beta"]


@pytest.fixture
def shared_tmp(tmp_path):
    """A folder both fake nodes (and the accounts) can read and write."""
    tmp_path.chmod(0o777)
    return tmp_path


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as (env, _):
        yield env


def _profile(path: Path, name: str, conf: str, procs: int | None = None) -> str:
    path.write_text(f'cluster = "{name}"\nslurm_conf = "{conf}"\n' + (f"procs_per_node = {procs}\n" if procs else ""))
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


def _bucket(s3, monkeypatch) -> str:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an earlier module's client points at its own (stopped) server
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    bucket = f"ts-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return bucket


JOB = ["--setup", "multi-gpu", "--cpu", "--job-name", "trainstack-test", "--time", "00:10:00", "--no-snapshot",
       "--python", sys.executable]  # this venv's python on the nodes (CI does not put it first on PATH)


def _preempt_alpha_once_committed(follower: subprocess.Popen, url: str, alpha_env: dict[str, str],
                                  which: list[str], wait_s: float = 300) -> tuple[str, float]:
    """Once alpha committed step 6 to the store, alpha's partition goes down and the run's job (squeue ``which``) is
    requeued there -- preempted, it waits; the follower's output once it ended, and when alpha was preempted."""
    from trainstack._checkpoint.store import Store

    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and follower.poll() is None and \
                not any(step >= 6 for (step, _), _ in Store(url).committed()):
            time.sleep(0.5)
        assert any(step >= 6 for (step, _), _ in Store(url).committed()), "alpha committed nothing to the store"
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=DOWN"], env=alpha_env, check=True)
        jobs = subprocess.run(["squeue", "-h", *which, "-o", "%i"], env=alpha_env, capture_output=True,
                              text=True).stdout.split()
        assert jobs, "the run's job is not on alpha"
        subprocess.run(["scontrol", "requeue", jobs[0]], env=alpha_env, check=True)
        preempted = time.time()
        out, _ = follower.communicate(timeout=wait_s)
    finally:
        subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], env=alpha_env)
        if follower.poll() is None:
            os.killpg(follower.pid, 9)
            follower.communicate()
    return out, preempted


def _move(env: dict[str, str], alpha_conf: str, profiles: list[str], url: str, root: Path, logs: Path,
          extra: list[str]) -> tuple[str, float]:
    """The follower on alpha and beta; once alpha committed step 6 to the store, alpha's partition goes down and
    the job is requeued there (preempted: it waits). The follower's output and when alpha was preempted."""
    follower = subprocess.Popen(
        [sys.executable, "-m", "trainstack", "submit", *[w for p in profiles for w in ("--cluster", p)],
         "--store", url, "--move-cost", "30", *JOB, *extra, "--log-dir", str(logs), "--env", f"OUT_ROOT={root}",
         "--env", "STEP_SLEEP=0.4", "--", PROGRAM], env=env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, preempted = _preempt_alpha_once_committed(follower, url, {**env, "SLURM_CONF": alpha_conf},
                                                   ["-n", "trainstack-test"], wait_s=360)
    assert follower.returncode == 0, out[-4000:]
    assert re.search(r"run on alpha: job \d+ \(first placement", out), out
    assert "waits on alpha" in out and "moving" in out and re.search(r"run on beta: job \d+", out), out
    assert "the run completed on beta" in out, out
    assert "the run across 2 cluster(s), 2 job(s): goodput" in out, out
    # the run's ledger across clusters, in the store: alpha's wait after the preemption, beta's download
    from trainstack._checkpoint.store import Store

    store = Store(url)
    store.fs.invalidate_cache()  # this process listed the prefix before the follower wrote the ledger
    assert store.fs.exists(f"{store.root}/run-ledger.json"), out[-3000:]
    found = json.loads(store.fs.cat_file(f"{store.root}/run-ledger.json"))
    assert found["jobs"] == 2 and found["parts"]["pending_elsewhere"] > 0 and found["parts"]["startup"] > 0
    beta_attempt = _lease.attempts(store.fs, store.root)[-1]
    assert beta_attempt["cluster"] == "beta" and beta_attempt["download_s"] >= 0 and beta_attempt["downloaded"]
    assert found["parts"]["transfer"] == pytest.approx(beta_attempt["download_s"], abs=0.01)
    return out, preempted


def test_a_preempted_run_moves_to_the_other_cluster_and_ends_as_if_it_never_moved(slurm_env, beta, s3, shared_tmp,
                                                                                    monkeypatch):
    bucket = _bucket(s3, monkeypatch)
    env = {**slurm_env, **s3, "PYTHONPATH": str(ROOT)}
    alpha_profile = _profile(shared_tmp / "alpha.toml", "alpha", slurm_env["SLURM_CONF"])
    beta_profile = _profile(shared_tmp / "beta.toml", "beta", beta)
    two = ["--procs-per-node", "2"]

    # the run that never moves: alpha alone, the same world size
    ref_root = shared_tmp / "ref"
    ref = subprocess.run([sys.executable, "-m", "trainstack", "submit", "--profile", alpha_profile, *JOB, *two,
                          "--log-dir", str(shared_tmp / "logs"), "--wait", "--env", f"OUT_ROOT={ref_root}",
                          "--env", "TRAINSTACK_CLUSTER=alpha",
                          "--env", f"TRAINSTACK_CHECKPOINT_STORE=s3://{bucket}/ref", "--", PROGRAM],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    moved_root = shared_tmp / "moved"
    url = f"s3://{bucket}/moved"
    out, preempted = _move(env, slurm_env["SLURM_CONF"], [alpha_profile, beta_profile], url, moved_root,
                           shared_tmp / "logs", two)
    print("\n" + next(line for line in out.splitlines() if "goodput" in line))

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
    # why says which guarantee the attempt kept
    job = re.search(r"run on beta: job (\d+)", out).group(1)
    why = subprocess.run([sys.executable, "-m", "trainstack", "why", job], env={**env, "SLURM_CONF": beta},
                         capture_output=True, text=True, timeout=120).stdout
    assert "run: this attempt writes" in why and "as epoch 2 after alpha" in why and "bitwise equality held" in why


@ci_leaves_out("placement on two real clusters: the preempted move and the first placement")
def test_hedged_the_first_job_to_start_is_kept(slurm_env, beta, s3, shared_tmp, monkeypatch):
    """--hedge: the run is submitted to both clusters; the first job that runs is kept, the other cancelled; the run
    completes with one lineage whichever of them took the lease last."""
    bucket = _bucket(s3, monkeypatch)
    env = {**slurm_env, **s3, "PYTHONPATH": str(ROOT)}
    profiles = [_profile(shared_tmp / "alpha.toml", "alpha", slurm_env["SLURM_CONF"]),
                _profile(shared_tmp / "beta.toml", "beta", beta)]
    url = f"s3://{bucket}/hedged"
    out = subprocess.run(
        [sys.executable, "-m", "trainstack", "submit", *[w for p in profiles for w in ("--cluster", p)], "--hedge",
         "--store", url, *JOB, "--procs-per-node", "2", "--log-dir", str(shared_tmp / "logs"),
         "--env", f"OUT_ROOT={shared_tmp / 'hedged'}", "--", PROGRAM], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=400)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert re.search(r"run on alpha: job \d+ \(first placement; hedged", said), said
    assert re.search(r"run on beta: job \d+ \(first placement; hedged", said), said
    assert re.search(r"cancelled job \d+ on (alpha|beta): the hedge's job \d+ on (alpha|beta) started first", said)
    assert "the run completed on" in said
    from trainstack._checkpoint.store import Store

    store = Store(url)
    epochs = _lease.history(store.fs, store.root)
    newest = store.committed()[-1]
    assert newest[0][0] == 24 and store.manifest(newest[1])["epoch"] == epochs[-1]["epoch"]


def _ids(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_move_to_a_cluster_with_fewer_processes_keeps_the_global_batch_and_every_sample_once(
        slurm_env, beta, s3, shared_tmp, monkeypatch):
    """alpha runs 2 processes, beta 1 (each profile says): after the move beta accumulates 2 batches per step, so
    an epoch is the same 12 steps, and epoch 1 -- half on alpha, half on beta -- trains on each of the 96 samples
    once; bitwise equality is not promised across the change, and the attempt says so."""
    bucket = _bucket(s3, monkeypatch)
    env = {**slurm_env, **s3, "PYTHONPATH": str(ROOT)}
    alpha_profile = _profile(shared_tmp / "alpha.toml", "alpha", slurm_env["SLURM_CONF"], procs=2)
    beta_profile = _profile(shared_tmp / "beta.toml", "beta", beta, procs=1)
    root, url = shared_tmp / "moved", f"s3://{bucket}/moved"
    _move(env, slurm_env["SLURM_CONF"], [alpha_profile, beta_profile], url, root, shared_tmp / "logs", [])
    log = "\n".join(p.read_text() for p in (shared_tmp / "logs").rglob("*.out"))
    assert "running on 1 of the 2 planned processes: gradient_accumulation_steps 1 -> 2" in log
    assert "bitwise equality NOT guaranteed: world_size 2 -> 1" in log
    steps = {step for step, _ in _losses(root / "beta" / "run")}
    resumed, last = min(steps) - 1, max(steps)
    assert last == 24  # 12 steps per epoch on either cluster: the global batch kept
    alpha = [ids for rank in (0, 1) for ids in _ids(root / "alpha" / f"ids-rank{rank}.jsonl")[:resumed]]
    beta_rows = _ids(root / "beta" / "ids-rank0.jsonl")
    assert len(beta_rows) == 2 * (last - resumed)  # two batches per step
    epoch1 = alpha + beta_rows[:2 * (12 - resumed)]
    assert sorted(i for row in epoch1 for i in row) == list(range(96))  # every sample of epoch 1 once
    epoch2 = beta_rows[2 * (12 - resumed):]
    assert sorted(i for row in epoch2 for i in row) == list(range(96))


def test_the_first_placement_picks_the_cluster_with_free_nodes(slurm_env, beta, shared_tmp):
    """alpha's two nodes are taken by another job: sbatch --test-only there says later, beta's are free -- the run
    goes to beta; once alpha's partition is down it cannot start there at all."""
    from trainstack._slurm.clusters import Cluster, Follower, choose

    alpha_env = {**slurm_env}
    blocker = subprocess.run(["sbatch", "--parsable", "--job-name", "trainstack-test", "--nodes", "2", "--exclusive",
                              "--time", "00:05:00", "--output", "/dev/null", "--wrap", "sleep 240"],
                             env=alpha_env, capture_output=True, text=True, check=True).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["squeue", "-h", "-j", blocker, "-o", "%T"], env=alpha_env, capture_output=True,
                             text=True).stdout.strip() != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
        clusters = [Cluster("alpha", _profile(shared_tmp / "a.toml", "alpha", slurm_env["SLURM_CONF"]),
                            slurm_conf=slurm_env["SLURM_CONF"]),
                    Cluster("beta", _profile(shared_tmp / "b.toml", "beta", beta), slurm_conf=beta)]
        follower = Follower(clusters, ["--setup", "multi-node", "--nodes", "2", "--cpu", "--procs-per-node", "1",
                                       "--time", "00:05:00", "--", "train.py"], "s3://unused/run", print)
        starts = follower.expected_starts()
        assert starts["beta"] is not None and starts["beta"] < 30
        assert starts["alpha"] is None or starts["alpha"] > 60, starts  # behind the 240 s job
        assert choose(starts, None, 120.0, 60.0) == "beta"
    finally:
        subprocess.run(["scancel", blocker], env=alpha_env)


@pytest.fixture(scope="module")
def accounts(slurms, s3):
    """Each cluster behind its own login: tsalpha's sshd gives alpha's SLURM_CONF, tsbeta's beta's (both the store's
    endpoint); an ssh config naming them as a laptop user has it."""
    if os.geteuid() != 0 or not shutil.which("sshd") or not shutil.which("rsync"):
        pytest.skip("needs root, openssh-server and rsync (CI installs them)")
    trainstack = remote_install()
    tmp = keys("trainstack-clusters-")
    runtime = Path(tempfile.mkdtemp(prefix="tsr-", dir="/tmp"))
    config = tmp / "ssh_config"
    with contextlib.ExitStack() as stack:
        hosts = []
        for user, conf in (("tsalpha", slurms["alpha"]), ("tsbeta", slurms["beta"])):
            account(user)
            port = stack.enter_context(sshd(tmp, user, {"SLURM_CONF": conf, **s3}, tmp / "authorized_keys"))
            hosts.append(f"Host {user}\n  HostName 127.0.0.1\n  Port {port}\n  User {user}\n"
                         f"  IdentityFile {tmp}/id\n  IdentitiesOnly yes\n  UserKnownHostsFile {tmp}/known_hosts\n"
                         f"  StrictHostKeyChecking accept-new\n")
        config.write_text("".join(hosts))
        env = {**os.environ, "SLURM_CONF": slurms["alpha"], **s3, "TRAINSTACK_SSH_CONFIG": str(config),
               "XDG_RUNTIME_DIR": str(runtime),
               "TRAINSTACK_REMOTE_TRAINSTACK": str(trainstack), "TRAINSTACK_REMOTE_INDEX_DIR": str(tmp / "index"),
               "PYTHONPATH": str(ROOT)}
        env.pop("TRAINSTACK_HOST", None)
        try:
            yield env, tmp
        finally:
            for user in ("tsalpha", "tsbeta"):
                subprocess.run(["ssh", "-F", str(config), "-o", f"ControlPath={runtime}/trainstack-ssh/%C", "-O",
                                "exit", user], capture_output=True, timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(runtime, ignore_errors=True)


@ci_leaves_out("ssh on real sshd: tests/slurm/test_remote.py; the move: "
               "test_a_preempted_run_moves_to_the_other_cluster")
def test_from_a_laptop_each_cluster_behind_its_own_login(accounts, slurm_env, s3, monkeypatch):
    """The same move with every command over ssh: the code shipped to each account by rsync, the job submitted,
    watched, preempted on alpha (tsalpha), continued on beta (tsbeta) from the store; one run id, one lineage."""
    env, tmp = accounts
    bucket = _bucket(s3, monkeypatch)
    repo = tmp / "laptop"
    repo.mkdir()
    shutil.copy(ROOT / PROGRAM, repo / "train.py")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    out_root = Path(tempfile.mkdtemp(prefix="ts-across-", dir="/tmp"))
    out_root.chmod(0o777)
    profiles = []
    for name in ("alpha", "beta"):
        profile = tmp / f"{name}.toml"
        profile.write_text(f'cluster = "{name}"\nhost = "ts{name}"\npython = "{VENV}/bin/python"\n'
                           f"procs_per_node = 2\n")
        profile.chmod(0o644)
        profiles += ["--cluster", str(profile)]
    url = f"s3://{bucket}/remote"
    follower = subprocess.Popen(
        [sys.executable, "-m", "trainstack", "submit", *profiles, "--store", url, "--move-cost", "30",
         "--setup", "multi-gpu", "--cpu", "--job-name", "trainstack-test", "--time", "00:10:00",
         "--env", f"OUT_ROOT={out_root}", "--env", "STEP_SLEEP=0.4", "--env", f"PYTHONPATH={VENV}/src",
         "--", "train.py"], env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    out, _ = _preempt_alpha_once_committed(follower, url, {**env, "SLURM_CONF": slurm_env["SLURM_CONF"]},
                                           ["-u", "tsalpha"], wait_s=400)
    try:
        assert follower.returncode == 0, out[-4000:]
        assert re.search(r"run on alpha: job \d+", out) and re.search(r"run on beta: job \d+", out), out
        assert "the run completed on beta" in out, out
        assert (out_root / "beta" / "final.pt").exists()
        ids = {json.loads((out_root / c / "run" / "run.json").read_text())["run_id"] for c in ("alpha", "beta")}
        assert len(ids) == 1
        lines = _lease.describe(url)
        assert "epoch 1: alpha" in lines[1] and "epoch 2: beta" in lines[2], lines
    finally:
        shutil.rmtree(out_root, ignore_errors=True)

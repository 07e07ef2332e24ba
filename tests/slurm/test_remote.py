"""`--host` from a laptop, for real: an OpenSSH server on 127.0.0.1 (its own sshd -f config on a free port, a
throw-away key, started and stopped by pid) in front of the local 2-node Slurm, logged into as a second Unix user
(`tsremote`) with its own trainstack install and remote dir. The "laptop" is a git repository in a temp folder."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _sshd import VENV, free_port, remote_install
from helpers import ROOT, ci_leaves_out

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(500)]
USER = "tsremote"
PROGRAM = """import os, sys, time
from helper import VERSION
for step in range(1, int(os.environ.get("STEPS", "6")) + 1):
    print(f"epoch 1 | step {step} | loss {1 / step:.4f} | version {VERSION} | args {sys.argv[1:]}", flush=True)
    time.sleep(float(os.environ.get("PAUSE", "0.5")))
"""


@pytest.fixture(scope="module")
def cluster(slurm_env):
    """(the environment a laptop user has: an ssh config naming the host `tscluster`, ...) with sshd running."""
    if os.geteuid() != 0 or not shutil.which("sshd") or not shutil.which("rsync"):
        pytest.skip("needs root, openssh-server and rsync (CI installs them)")
    if subprocess.run(["id", USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True)
    subprocess.run(["usermod", "-p", "*", USER], check=True)  # no password, but not locked: sshd refuses a locked one
    home = Path(pwd.getpwnam(USER).pw_dir)
    trainstack = remote_install()
    tmp = Path(tempfile.mkdtemp(prefix="trainstack-sshd-", dir="/tmp"))  # sshd reads the keys as the user:
    tmp.chmod(0o755)  # pytest's own folders (0700) are out of its reach
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "other")], check=True)
    (tmp / "authorized_keys").write_text((tmp / "id.pub").read_text())
    (tmp / "authorized_keys").chmod(0o644)
    port = free_port()
    conf = tmp / "sshd_config"
    conf.write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp}/host_key\nPidFile {tmp}/sshd.pid\n"
                    f"AuthorizedKeysFile {tmp}/authorized_keys\nStrictModes no\nPasswordAuthentication no\n"
                    f"KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin no\nAllowUsers {USER}\n"
                    f"SetEnv SLURM_CONF={slurm_env['SLURM_CONF']}\nMaxSessions 50\n"
                    f"Subsystem sftp internal-sftp\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    subprocess.run(["/usr/sbin/sshd", "-f", str(conf), "-E", str(tmp / "sshd.log")], check=True)
    config = tmp / "ssh_config"
    common = (f"  HostName 127.0.0.1\n  Port {port}\n  User {USER}\n  UserKnownHostsFile {tmp}/known_hosts\n"
              f"  StrictHostKeyChecking accept-new\n  IdentitiesOnly yes\n")
    # wrongkey: another HostName for the same server, so it cannot ride on tscluster's multiplexed connection
    config.write_text(f"Host tscluster\n{common}  IdentityFile {tmp}/id\n"
                      f"Host wrongkey\n{common.replace('127.0.0.1', 'localhost')}  IdentityFile {tmp}/other\n"
                      f"Host nowhere\n  HostName 127.0.0.1\n  Port {free_port()}\n  User {USER}\n")
    runtime = Path(tempfile.mkdtemp(prefix="tsr-", dir="/tmp"))  # short: the sockets live in it, not a fallback
    env = {**slurm_env, "TRAINSTACK_SSH_CONFIG": str(config), "XDG_RUNTIME_DIR": str(runtime),
           "TRAINSTACK_REMOTE_TRAINSTACK": str(trainstack), "TRAINSTACK_REMOTE_INDEX_DIR": str(tmp / "index"),
           "PYTHONPATH": str(ROOT)}
    env.pop("TRAINSTACK_HOST", None)
    try:
        yield env, home, tmp
    finally:
        subprocess.run(["ssh", "-F", str(config), "-o", f"ControlPath={runtime}/trainstack-ssh/%C", "-O", "exit",
                        "tscluster"], capture_output=True, timeout=30)
        pid = int((tmp / "sshd.pid").read_text())
        os.kill(pid, signal.SIGTERM)
        subprocess.run(["pkill", "-u", USER], check=False)  # the account's leftovers (none expected)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)


def ts(env, *args, cwd=None, check=True, timeout=240):
    out = subprocess.run([sys.executable, "-m", "trainstack", *args], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"trainstack {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out


TRAINER = """import sys, time, torch
from torch.utils.data import DataLoader, TensorDataset
from trainstack import Callback, TrainConfig, Trainer

def slow(trainer, config, writer):
    time.sleep(0.25)

data = DataLoader(TensorDataset(torch.randn(320, 4), torch.randn(320, 1)), batch_size=8)
model = torch.nn.Linear(4, 1)
config = TrainConfig(compute_setup="cpu", max_iter=2, log_folder="runs/remote", log_every_n_steps=10,
                     callbacks=[Callback(on="train_batch_end", callback=slow)])
Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), config, loss_fn="mse").fit(data)
"""


def _laptop(tmp: Path) -> Path:
    repo = tmp / "laptop" / "project"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "train.py").write_text(PROGRAM)
    (repo / "src" / "fit.py").write_text(TRAINER)
    (repo / "src" / "helper.py").write_text('VERSION = "one"\n')
    (repo / ".gitignore").write_text("data/\n")
    (repo / "data").mkdir()
    (repo / "data" / "big.bin").write_bytes(os.urandom(1 << 20))  # ignored by git: never shipped
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    return repo


def _sent(stderr: str) -> int:
    return int(re.search(r"\(([\d,]+) bytes sent", stderr).group(1).replace(",", ""))


def _job_of(out: str) -> str:
    return next(line.split()[1] for line in out.splitlines() if line.startswith("job "))


def test_the_laptop_workflow_submit_follow_status_cancel_fetch(cluster, tmp_path):
    env, home, _ = cluster
    repo = _laptop(tmp_path)
    submit = ["submit", "--host", "tscluster", "--cpu", "--time", "5", "--job-name", "trainstack-test",
              "--python", "/usr/bin/python3", "--", "train.py", "--lr", "0.1"]
    started = time.monotonic()
    first = ts(env, *submit[:-4], "--hold", *submit[-4:], cwd=repo / "src")
    to_job_id = time.monotonic() - started
    held = _job_of(first.stdout)
    assert "shipped 4 file(s)" in first.stderr and "big.bin" not in first.stderr, first.stderr
    sent_first = _sent(first.stderr)
    code = home / "trainstack-remote" / "code"
    assert not list(code.glob("*/data/big.bin"))  # git-ignored data stays on the laptop

    (repo / "src" / "helper.py").write_text('VERSION = "two"\n')  # edited after the first submission
    second = ts(env, *submit, cwd=repo / "src", check=True)
    job = _job_of(second.stdout)
    sent_second = _sent(second.stderr)
    assert sent_second < sent_first, (sent_first, sent_second)
    print(f"submit --host: job id after {to_job_id:.1f} s; bytes sent: first {sent_first}, second {sent_second}")

    followed = ts(env, "logs", "--host", "tscluster", "--follow", job, timeout=200)
    assert "step 6 | loss 0.1667 | version two | args ['--lr', '0.1']" in followed.stdout, followed.stdout
    status = ts(env, "status", "--host", "tscluster", job).stdout
    assert "COMPLETED" in status and "step 6" in status, status

    subprocess.run(["scontrol", "release", held], env=env, check=True)  # the first job runs its own snapshot
    old = ts(env, "logs", "--host", "tscluster", "--follow", held, timeout=200).stdout
    assert "version one" in old and "version two" not in old, old

    fetched = ts(env, "fetch", "--host", "tscluster", job, "-o", str(tmp_path / "got")).stdout
    assert "fetched" in fetched and (tmp_path / "got" / "metadata.json").exists()
    assert list((tmp_path / "got").glob("rank-0.out")) or list((tmp_path / "got").glob("*.out"))

    slow = ts(env, *submit[:-4], "--env", "STEPS=200", *submit[-4:], cwd=repo / "src")
    victim = _job_of(slow.stdout)
    assert "cancelled" in ts(env, "cancel", "--host", "tscluster", victim).stdout
    listed = ts(env, "status", check=False).stdout  # the laptop's own list: every --host job, asked per host
    assert f"tscluster  {job}  COMPLETED" in listed and "step 6" in listed, listed
    index = json.loads((Path(env["TRAINSTACK_REMOTE_INDEX_DIR"]) / "remote-jobs.json").read_text())
    assert {r["job"] for r in index} >= {held, job, victim}
    assert oct((Path(env["TRAINSTACK_REMOTE_INDEX_DIR"]) / "remote-jobs.json").stat().st_mode & 0o777) == "0o600"


def test_follow_survives_a_dropped_connection_without_duplicate_lines(cluster, tmp_path):
    env, _, tmp = cluster
    repo = _laptop(tmp_path)
    out = ts(env, "submit", "--host", "tscluster", "--cpu", "--time", "5", "--job-name", "trainstack-test",
             "--python", "/usr/bin/python3", "--env", "STEPS=16", "--", "train.py", cwd=repo / "src")
    job = _job_of(out.stdout)
    follower = subprocess.Popen([sys.executable, "-m", "trainstack", "logs", "--host", "tscluster", "--follow", job],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)
    control = Path(env["XDG_RUNTIME_DIR"]) / "trainstack-ssh"
    master = subprocess.run(["ssh", "-F", env["TRAINSTACK_SSH_CONFIG"], "-o", f"ControlPath={control}/%C", "-O",
                             "check", "tscluster"], capture_output=True, text=True).stderr
    pid = int(master.split("pid=")[1].split(")")[0])
    os.kill(pid, signal.SIGKILL)  # the connection drops mid-follow
    stdout, stderr = follower.communicate(timeout=200)
    steps = [re.search(r"\| step (\d+)", line) for line in stdout.splitlines() if line.startswith("epoch ")]
    assert [int(s[1]) for s in steps if s] == list(range(1, 17)), stdout
    assert "reconnecting" in stderr, stderr


def test_bad_hosts_give_clear_errors_fast(cluster, tmp_path):
    env, _, _ = cluster
    for host, expected in (("nowhere", "unreachable"), ("wrongkey", "refused the key")):
        started = time.monotonic()
        out = ts(env, "status", "--host", host, "123", check=False, timeout=60)
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert time.monotonic() - started < 40
    missing = ts({**env, "TRAINSTACK_REMOTE_TRAINSTACK": "/nonexistent/trainstack"}, "submit", "--host",
                 "tscluster", "--cpu", "--", "train.py", cwd=_laptop(tmp_path) / "src", check=False)
    assert missing.returncode == 2 and "trainstack is not installed on tscluster" in missing.stderr, missing.stderr
    fresh = tempfile.mkdtemp(prefix="tsf-", dir="/tmp")  # short, so it is the control folder: no master there
    reuse = ts({**env, "TRAINSTACK_SSH_REUSE_ONLY": "1", "XDG_RUNTIME_DIR": fresh}, "status", "--host",
               "tscluster", check=False)
    shutil.rmtree(fresh, ignore_errors=True)
    assert reuse.returncode == 2 and "ssh -fN" in reuse.stderr, reuse.stderr


def test_hostile_names_and_arguments_stay_inert_on_the_remote_shell(cluster, tmp_path):
    env, home, _ = cluster
    repo = _laptop(tmp_path)
    canary = Path("/tmp/trainstack-remote-canary")
    canary.unlink(missing_ok=True)
    common = ["submit", "--host", "tscluster", "--cpu", "--time", "5", "--python", "/usr/bin/python3", "--env",
              "STEPS=1"]
    named = ts(env, *common, "--job-name", f"trainstack-test;touch {canary}", "--", "train.py", cwd=repo / "src",
               check=False)
    assert named.returncode == 2 and "--job-name" in named.stderr and "contains '/'" in named.stderr, named.stderr
    hostile = [f"$(touch {canary})", f"`touch {canary}`", f"'; touch {canary}; '", "a b\nc"]
    out = ts(env, *common, "--job-name", "trainstack-test;$(id)", "--", "train.py", *hostile, cwd=repo / "src")
    log = ts(env, "logs", "--host", "tscluster", "--follow", _job_of(out.stdout), timeout=200).stdout
    assert f"args {hostile!r}" in log, log  # every argument arrived as the text it was
    assert not canary.exists()


def test_a_profile_names_the_login_node(cluster, tmp_path):
    env, _, _ = cluster
    repo = _laptop(tmp_path)
    (repo / "cluster.toml").write_text('host = "tscluster"\nremote_dir = "elsewhere"\ncpu = true\n')
    out = ts(env, "submit", "--profile", "../cluster.toml", "--time", "5", "--job-name", "trainstack-test",
             "--python", "/usr/bin/python3", "--env", "STEPS=1", "--", "train.py", cwd=repo / "src")
    assert "tscluster:elsewhere/code/project-" in out.stderr, out.stderr
    log = ts(env, "logs", "--host", "tscluster", "--follow", _job_of(out.stdout), timeout=200).stdout
    assert "step 1 | loss 1.0000" in log, log


@ci_leaves_out("the laptop workflow over real sshd: "
               "test_the_laptop_workflow_submit_follow_status_cancel_fetch; debug: tests/slurm/test_hang.py")
def test_a_trainer_job_from_afar_debug_fetch_and_inspect(cluster, tmp_path):
    env, _, _ = cluster
    repo = _laptop(tmp_path)
    out = ts(env, "submit", "--host", "tscluster", "--cpu", "--time", "5", "--job-name", "trainstack-test",
             "--python", f"{VENV}/bin/python", "--env", f"PYTHONPATH={VENV}/src", "--", "fit.py", cwd=repo / "src")
    job = _job_of(out.stdout)
    deadline = time.monotonic() + 150
    while "RUNNING" not in (state := ts(env, "status", "--host", "tscluster", job).stdout) or "step" not in state:
        assert time.monotonic() < deadline and "COMPLETED" not in state, state
        time.sleep(1)
    debug = ts(env, "debug", "--host", "tscluster", job, timeout=120).stdout
    assert "stacks:" in debug and "rank 0" in debug, debug
    ts(env, "logs", "--host", "tscluster", "--follow", job, timeout=200)
    run = ts(env, "fetch", "--host", "tscluster", job, "--what", "run", "-o", str(tmp_path / "run")).stdout
    assert "fetched" in run and (tmp_path / "run" / "metrics.jsonl").exists(), run
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))
    ts(env, "fetch", "--host", "tscluster", job, "-o", str(tmp_path / "job"))
    named = (tmp_path / "job" / "run-folder").read_text().strip()  # the job folder names its run folder
    assert named.endswith("runs/remote"), named
    inspected = ts(env, "checkpoint", "inspect", "--host", "tscluster", named).stdout
    assert "step" in inspected and "epoch" in inspected, inspected


def _first_line_s(env, argv, cwd, follow):
    """Seconds from starting ``trainstack submit ...`` to the job's first training line on our screen."""
    started = time.monotonic()
    job = _job_of(ts(env, *argv, cwd=cwd).stdout)
    submitted = time.monotonic() - started
    proc = subprocess.Popen([sys.executable, "-m", "trainstack", "logs", *follow, "--follow", job], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("epoch 1 | step 1"):
                return submitted, time.monotonic() - started
    finally:
        proc.kill()
        proc.wait(timeout=30)
    raise AssertionError("no first line")


def test_time_to_job_id_and_first_line_from_the_laptop_vs_the_login_node(cluster, tmp_path):
    env, _, _ = cluster
    repo = _laptop(tmp_path)
    common = ["--cpu", "--time", "5", "--job-name", "trainstack-test", "--python", "/usr/bin/python3", "--env",
              "STEPS=2", "--", "train.py"]
    here = _first_line_s(env, ["submit", *common], repo / "src", [])
    afar = _first_line_s(env, ["submit", "--host", "tscluster", *common], repo / "src", ["--host", "tscluster"])
    print(f"job id / first log line: on the login node {here[0]:.1f} s / {here[1]:.1f} s; "
          f"from the laptop (--host) {afar[0]:.1f} s / {afar[1]:.1f} s")
    assert afar[1] < here[1] + 15  # ssh, rsync and one remote submit cost seconds, not minutes


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_dropped_connection_during_submit_never_makes_a_second_job(cluster, tmp_path, when):
    """The connection drops while the login node submits (its trainstack slowed down before or after sbatch): the
    laptop asks again over a new connection, finds the job by its submission token and records it -- "submitted as
    job N", exit 0 -- instead of "cannot reach", which made users submit twice."""
    env, _, tmp = cluster
    repo = _laptop(tmp_path)
    slow = tmp / f"slow-{when}"  # the account's trainstack, slowed where the connection will drop
    real = env["TRAINSTACK_REMOTE_TRAINSTACK"]
    body = (f'case "$1" in submit) sleep 4; exec {real} "$@";; esac; exec {real} "$@"' if when == "before" else
            f'case "$1" in submit) {real} "$@"; rc=$?; sleep 6; exit $rc;; esac; exec {real} "$@"')
    slow.write_text(f"#!/bin/sh\n{body}\n")
    slow.chmod(0o755)
    env = {**env, "TRAINSTACK_REMOTE_TRAINSTACK": str(slow)}
    submitter = subprocess.Popen([sys.executable, "-m", "trainstack", "submit", "--host", "tscluster", "--cpu",
                                  "--time", "5", "--job-name", "trainstack-test", "--python", "/usr/bin/python3",
                                  "--hold", "--", "train.py"], env=env, cwd=repo / "src", stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    control = Path(env["XDG_RUNTIME_DIR"]) / "trainstack-ssh"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # before: the wrapper sleeps before sbatch; after: the job is queued
        if when == "before":
            ready = subprocess.run(["pgrep", "-u", USER, "-f", "sleep 4"], capture_output=True, text=True).stdout
        else:
            ready = subprocess.run(["squeue", "-h", "-n", "trainstack-test", "-o", "%i"], env=env,
                                   capture_output=True, text=True).stdout
        if ready.strip():
            break
        time.sleep(0.1)
    master = subprocess.run(["ssh", "-F", env["TRAINSTACK_SSH_CONFIG"], "-o", f"ControlPath={control}/%C", "-O",
                             "check", "tscluster"], capture_output=True, text=True).stderr
    os.kill(int(master.split("pid=")[1].split(")")[0]), signal.SIGKILL)  # the connection drops
    out, err = submitter.communicate(timeout=120)
    assert submitter.returncode == 0 and "dropped during the submission, but it was submitted" in err, out + err
    job = _job_of(out)
    try:
        queued = subprocess.run(["squeue", "-h", "-n", "trainstack-test", "-o", "%i %k"], env=env,
                                capture_output=True, text=True).stdout.split("\n")
        mine = [line for line in queued if line.strip()]
        assert len(mine) == 1 and mine[0].split()[0] == job and "trainstack-submission:" in mine[0], queued
        index = json.loads((Path(env["TRAINSTACK_REMOTE_INDEX_DIR"]) / "remote-jobs.json").read_text())
        assert job in {r["job"] for r in index}
    finally:
        subprocess.run(["scancel", "-n", "trainstack-test"], env=env)


def test_odd_file_names_and_a_long_runtime_folder_ship_as_they_are(cluster, tmp_path):
    """Any byte but NUL may be in a file name: a newline (which once split one name into two, shipping an ignored
    .env) and a name that is not UTF-8 ship as themselves; a runtime folder too long for a socket path falls back
    to a short private one."""
    env, home, _ = cluster
    repo = _laptop(tmp_path)
    (repo / "src" / ".env").write_text("SECRET=1\n")
    (repo / ".gitignore").write_text("data/\n.env\n")
    (repo / "src" / "x\n.env").write_text("newline\n")
    (repo / "src").joinpath(os.fsdecode(b"caf\xe9.txt")).write_text("latin-1\n")
    long_runtime = tmp_path / ("r" * 70)
    long_runtime.mkdir(mode=0o700)
    env = {**env, "XDG_RUNTIME_DIR": str(long_runtime)}
    out = ts(env, "submit", "--host", "tscluster", "--cpu", "--time", "5", "--job-name", "trainstack-test",
             "--python", "/usr/bin/python3", "--hold", "--", "train.py", cwd=repo / "src")
    job = _job_of(out.stdout)
    subprocess.run(["scancel", job], env=env)
    shipped = max((home / "trainstack-remote" / "code").glob("*/*"), key=lambda p: p.stat().st_mtime)
    names = {os.fsencode(p.name) for p in (shipped / "src").iterdir()}
    assert b"x\n.env" in names and b"caf\xe9.txt" in names and b".env" not in names, names

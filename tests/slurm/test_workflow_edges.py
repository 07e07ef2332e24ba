"""Edges of the Slurm workflow the second reliability probe found, on the real local cluster: a job folder deleted
while its job runs, task ids of plain jobs, another user's jobs, an unreadable file in a snapshot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_workflow import JOB, SLEEPER, STANDIN_APPTAINER, ts, wait_ended, wait_for_file

pytestmark = [pytest.mark.slurm]
REPO = Path(__file__).resolve().parents[2]
SITE = next(Path(sys.executable).parents[1].glob("lib/python3*/site-packages"), None)


@pytest.fixture
def env(slurm_env, shared_tmp):
    e = dict(slurm_env)
    e["PATH"] = f"{Path(sys.executable).parent}:{e['PATH']}"
    e["PYTHONPATH"] = str(REPO)
    e["XDG_STATE_HOME"] = str(shared_tmp / "state")
    e.pop("TRAINSTACK_SNAPSHOT", None)
    return e


DELETES_ITS_FOLDER = textwrap.dedent("""
    import os, shutil, time
    shutil.rmtree(os.environ["TRAINSTACK_JOB_DIR"])  # e.g. a user cleaning up logs/ while the job runs
    print("training finished fine", flush=True)
""")


@pytest.mark.timeout(240)
def test_a_job_whose_folder_is_deleted_while_it_runs_still_completes(env, shared_tmp):
    program = shared_tmp / "deletes.py"
    program.write_text(DELETES_ITS_FOLDER)
    out = ts(env, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(shared_tmp / "logs"),
             "--no-snapshot", "--", str(program), cwd=shared_tmp).stdout
    job = out.split()[1]
    rows = wait_ended(env, [job])[job]
    assert rows[0]["state"] == "COMPLETED", rows
    ranks = ts(env, "logs", job, "--rank", "0", check=False)
    assert ranks.returncode == 1 and "folder" in ranks.stderr and "deleted" in ranks.stderr


@pytest.mark.timeout(240)
def test_a_task_id_of_a_plain_job_is_a_clear_error(env, shared_tmp):
    out = ts(env, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(shared_tmp / "logs"),
             "--no-snapshot", "--hold", "--", SLEEPER, "1", cwd=shared_tmp).stdout
    job = out.split()[1]
    try:
        for command in ("status", "logs", "cancel"):
            result = ts(env, command, f"{job}_0", check=False)
            assert result.returncode == 1 and "not an array job" in result.stderr, (command, result.stderr)
    finally:
        ts(env, "cancel", job, check=False)


def _as_nobody(env: dict, *args: str) -> subprocess.CompletedProcess:
    """The trainstack CLI run by another local user (the system python with this checkout's packages: the CLI
    needs no torch)."""
    system = shutil.which("python3", path="/usr/bin")
    if os.getuid() != 0 or shutil.which("runuser") is None or system is None or SITE is None:
        pytest.skip("needs root, runuser and a system python3 to act as a second user")
    version = subprocess.run([system, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout
    if version.strip() != str(sys.version_info[:2]):
        pytest.skip(f"the system python ({version.strip()}) cannot use this venv's packages")
    user_env = {"PATH": env["PATH"], "SLURM_CONF": env["SLURM_CONF"], "PYTHONPATH": f"{SITE}:{REPO}",
                "HOME": "/tmp", "XDG_STATE_HOME": "/tmp/nobody-state"}
    return subprocess.run(["runuser", "-u", "nobody", "--", "env", *(f"{k}={v}" for k, v in user_env.items()),
                           system, "-m", "trainstack", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_cancel_and_debug_of_another_users_job_say_so(env, shared_tmp):
    probe = shared_tmp / "probe"
    probe.mkdir()
    out = ts({**env, "PROBE_OUT": str(probe)}, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir",
             str(shared_tmp / "logs"), "--no-snapshot", "--", SLEEPER, "120", cwd=shared_tmp).stdout
    job = out.split()[1]
    try:
        wait_for_file(probe / "ready")
        for command in ("cancel", "debug"):
            result = _as_nobody(env, command, job)
            assert result.returncode == 1 and "not to you" in result.stderr, result.stderr
            assert "Traceback" not in result.stderr
        status = _as_nobody(env, "status", job)
        assert status.returncode == 0 and "RUNNING" in status.stdout, status.stderr  # reading is fine
        assert not list((shared_tmp / "logs").glob("*/cancelled"))
    finally:
        ts(env, "cancel", job, check=False)


def test_an_unreadable_file_in_the_snapshot_is_named(env):
    import tempfile

    system = shutil.which("python3", path="/usr/bin")
    if os.getuid() != 0 or shutil.which("runuser") is None or system is None:
        pytest.skip("needs root and runuser to act as a second user")
    shared_tmp = Path(tempfile.mkdtemp(prefix="trainstack-shared-", dir="/tmp"))
    shared_tmp.chmod(0o777)
    try:
        _unreadable_in_snapshot(shared_tmp, system)
    finally:
        shutil.rmtree(shared_tmp, ignore_errors=True)


def _unreadable_in_snapshot(shared_tmp: Path, system: str) -> None:
    repo = shared_tmp / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    (repo / "secret.py").write_text("X = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", f"safe.directory={repo}", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    subprocess.run(["chown", "-R", "nobody", str(repo)], check=True)
    os.chown(repo / "secret.py", 0, 0)
    (repo / "secret.py").chmod(0o600)  # nobody cannot read this tracked file
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(SITE)!r}, {str(REPO)!r}]
        from pathlib import Path
        from trainstack._slurm.snapshot import SnapshotError, take
        try:
            take(Path({str(repo)!r}), Path({str(shared_tmp / 'code')!r}), exclude=[])
        except SnapshotError as exc:
            print("SNAPSHOT-ERROR", exc)
    """)
    proc = subprocess.run(["runuser", "-u", "nobody", "--", "env", "HOME=/tmp", system, "-c", code],
                          capture_output=True, text=True, timeout=60)
    assert "SNAPSHOT-ERROR" in proc.stdout and "secret.py" in proc.stdout and "HINT" in proc.stdout, proc


@pytest.mark.timeout(240)
def test_submit_refuses_what_could_never_run_and_leaves_nothing(env, shared_tmp):
    """A program that does not exist, GPUs asked of a partition without any (node3, partition cpuonly): errors at
    submit with the fix, nothing queued and no empty log folder left; --max-retries asks for --requeue."""
    work = shared_tmp / "refuse"
    work.mkdir()
    (work / "train.py").write_text("print('ok')\n")
    logs = work / "logs"
    missing = ts(env, "submit", "--cpu", "--job-name", JOB, "--log-dir", str(logs), "--no-snapshot", "--",
                 "nonexist.py", cwd=work, check=False)
    assert missing.returncode == 2 and "'nonexist.py' does not exist in" in missing.stderr, missing.stderr
    no_gpu = ts(env, "submit", "--partition", "cpuonly", "--job-name", JOB, "--log-dir", str(logs), "--no-snapshot",
                "--", "train.py", cwd=work, check=False)
    assert no_gpu.returncode == 2 and "no node of partition cpuonly has GPUs" in no_gpu.stderr, no_gpu.stderr
    assert "add --cpu" in no_gpu.stderr and "Traceback" not in no_gpu.stderr
    assert not logs.exists()
    queued = subprocess.run(["squeue", "-h", "-n", JOB], env=env, capture_output=True, text=True).stdout
    assert not queued.strip(), queued
    implied = ts(env, "submit", "--cpu", "--max-retries", "2", "--dry-run", "--", "train.py", cwd=work)
    assert "imply --requeue" in implied.stderr and "#SBATCH --requeue" in implied.stdout
    ran = ts(env, "submit", "--cpu", "--partition", "cpuonly", "--job-name", JOB, "--log-dir", str(logs),
             "--no-snapshot", "--wait", "--", "train.py", cwd=work)  # with --cpu the same partition is fine
    assert ran.returncode == 0 and "ok" in ran.stdout


@pytest.mark.timeout(240)
def test_the_job_index_belongs_to_its_cluster(env, shared_tmp):
    """Job ids repeat across clusters: once Slurm forgot a job, status/why/logs answer from this cluster's
    record, never from another cluster's with the same id (appended later to the same index)."""
    import json

    work = shared_tmp / "clusters"
    work.mkdir()
    (work / "train.py").write_text("print('mine', flush=True)\n")
    out = ts(env, "submit", "--cpu", "--job-name", JOB, "--log-dir", str(work / "logs"), "--no-snapshot", "--wait",
             "--", "train.py", cwd=work).stdout
    job = out.split("job ")[-1].split()[0]
    other = work / "other" / f"v6-segv-{job}"
    other.mkdir(parents=True)
    (other / "exit_code").write_text("139\n")
    (other / "started").write_text("2026-01-01T00:00:00+00:00\n")
    index = Path(env["XDG_STATE_HOME"]) / "trainstack" / "jobs.jsonl"
    with open(index, "a") as fh:  # what the same home's submission on another cluster recorded
        fh.write(json.dumps({"job_id": job, "name": "v6-segv", "job_dir": str(other), "log_dir": str(other.parent),
                             "log": str(other.parent / f"v6-segv-{job}.out"), "tasks": [], "launcher": "srun",
                             "cluster": "othercluster", "submitted": 1.0}) + "\n")
    assert '"cluster": "trainstack"' in index.read_text()
    deadline = time.monotonic() + 60
    while "COMPLETED" in subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                                        text=True).stdout and time.monotonic() < deadline:
        time.sleep(2)  # until Slurm forgot it (MinJobAge): the index answers
    status = ts(env, "status", job).stdout
    assert "v6-segv" not in status and JOB in status and "COMPLETED" in status, status
    assert "mine" in ts(env, "logs", job).stdout


@pytest.mark.timeout(240)
def test_status_lists_each_running_array_task_once(env, shared_tmp):
    work = shared_tmp / "array"
    work.mkdir()
    (work / "nap.py").write_text("import time, sys\nprint('napping', sys.argv[1:], flush=True)\ntime.sleep(30)\n")
    out = ts(env, "submit", "--cpu", "--job-name", JOB, "--log-dir", str(work / "logs"), "--no-snapshot", "--sweep",
             "n=1,2,3", "--max-parallel", "2", "--", "nap.py", cwd=work).stdout
    job = out.split("job ")[-1].split()[0]
    try:
        deadline = time.monotonic() + 90
        while True:
            table = ts(env, "status").stdout
            if table.count(" RUNNING ") >= 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        labels = [line.split()[0] for line in table.splitlines() if line.startswith(f"{job}_")]
        assert len(labels) == len(set(labels)) and f"{job}_0" in labels and f"{job}_1" in labels, table
    finally:
        ts(env, "cancel", job, check=False)


def test_a_blamed_node_slurm_holds_out_of_service_costs_the_requeue_no_room(slurm_env, tmp_path, monkeypatch):
    """Partition spares (node1-3), 2 nodes needed, node2 blamed and drained, then node3 blamed: node2 is left out at
    no cost, node3 cannot be (a requeue leaving out both could never start); before, node3 replaced node2 in the
    list and the requeued job waited for a node Slurm would not give it."""
    from trainstack._slurm.attempt import exclusions
    from trainstack._slurm.slurmcmd import Slurm

    slurm = Slurm("0", {**os.environ, **slurm_env, "SLURM_JOB_PARTITION": "spares"})
    assert exclusions(["node2", "node3"], slurm.partition_nodes(), 2) == (
        ["node3"], "a requeued attempt could not leave out node2 (no other node in the partition for 2 node(s))")
    drain = ["scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=trainstack-test"]
    subprocess.run(drain, env=slurm_env, check=True, timeout=30)
    try:
        keep, note = exclusions(["node2", "node3"], slurm.partition_nodes(), 2)
    finally:
        subprocess.run(["scontrol", "update", "NodeName=node2", "State=RESUME"], env=slurm_env, check=True,
                       timeout=30)
    assert keep == ["node2"] and note == ("a requeued attempt could not leave out node3 (no other node in the "
                                          "partition for 2 node(s))"), (keep, note)


@pytest.mark.timeout(300)
def test_a_container_job_on_a_host_without_trainstack_keeps_the_one_policy(slurm_env, shared_tmp):
    """The batch host's python3 has no trainstack (the image has it: an apptainer stand-in, the venv's python as
    the image's). Through ``trainstack submit`` the driver runs from the copy shipped in the job folder, so a crash
    is retried in the allocation as on bare metal; a plain sbatch of the generated script, with no copy to find,
    runs one plain launch and says so in its log (the crash then ends the job)."""
    bin_dir = shared_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STANDIN_APPTAINER)
    (bin_dir / "apptainer").chmod(0o755)
    (bin_dir / "python3").symlink_to("/usr/bin/python3")  # the host's own python: no trainstack, no torch
    image = shared_tmp / "image.sif"
    image.write_text("stand-in image")
    flaky = shared_tmp / "_flaky.py"
    shutil.copy(Path(__file__).with_name("_flaky.py"), flaky)
    env = {k: v for k, v in slurm_env.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", XDG_STATE_HOME=str(shared_tmp / "state"))
    common = ["--setup", "multi-node", "--nodes", "2", "--cpu", "--procs-per-node", "1", "--time", "5",
              "--job-name", JOB, "--log-dir", str(shared_tmp / "logs"), "--container", "apptainer", "--image",
              str(image), "--python", sys.executable, "--requeue", "--no-node-check", "--partition", "spares"]
    submitted = ts(env, "submit", *common, "--no-snapshot", "--wait", "--", str(flaky), "transient", cwd=shared_tmp,
                   check=False, timeout=240)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "from the copy shipped in the job folder" in submitted.stderr
    log = next((shared_tmp / "logs").glob(f"{JOB}-*.out")).read_text()
    assert "retrying in this allocation as step 1" in log and "cannot import trainstack" not in log, log
    script = shared_tmp / "plain.sbatch"
    made = ts(env, "generate", *common, "--log-dir", str(shared_tmp / "plain-logs"), "-o", str(script), "--",
              str(flaky), "transient", cwd=shared_tmp)
    assert "WITHOUT in-allocation recovery" in made.stderr
    ran = subprocess.run(["sbatch", "--wait", "--parsable", str(script)], cwd=shared_tmp, env=env,
                         capture_output=True, text=True, timeout=200)
    plain = next((shared_tmp / "plain-logs").glob(f"{JOB}-*.out")).read_text()
    assert ran.returncode != 0 and "WITHOUT in-allocation recovery" in plain, plain
    assert "retrying in this allocation" not in plain


@pytest.mark.timeout(120)
def test_more_spare_nodes_than_the_partition_has_are_refused_before_anything_is_queued(env, shared_tmp):
    """--nodes 2 --spare-nodes 5 on partition spares (3 nodes): refused with the count, nothing queued (it used to
    wait PENDING forever behind a hint that could not work)."""
    before = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    out = ts(env, "submit", "--setup", "multi-node", "--nodes", "2", "--cpu", "--spare-nodes", "5", "--partition",
             "spares", "--time", "5", "--job-name", JOB, "--log-dir", str(shared_tmp / "logs"), "--no-snapshot",
             "--", SLEEPER, "1", cwd=shared_tmp, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "the job would need 2 + 5 spare = 7 nodes, partition spares has 3" in out.stderr, out.stderr
    assert "--spare-nodes 1 at most" in out.stderr
    # probe 5 F11, F12: without --partition the default partition (debug: 2 nodes) is counted, not the cluster (3)
    out = ts(env, "submit", "--setup", "multi-node", "--nodes", "2", "--cpu", "--spare-nodes", "1", "--time", "5",
             "--job-name", JOB, "--log-dir", str(shared_tmp / "logs"), "--no-snapshot", "--", SLEEPER, "1",
             cwd=shared_tmp, check=False)
    assert out.returncode == 2 and "the default partition (debug) has 2" in out.stderr, out.stdout + out.stderr
    assert "--spare-nodes 0 at most" in out.stderr
    # UX review 4: --mem beyond every node was submitted held (which skips Slurm's check) and pended forever
    out = ts(env, "submit", "--cpu", "--mem", "64GB", "--time", "5", "--job-name", JOB, "--log-dir",
             str(shared_tmp / "logs"), "--no-snapshot", "--", SLEEPER, "1", cwd=shared_tmp, check=False)
    assert out.returncode != 0 and "Slurm refuses this job" in out.stderr and "Traceback" not in out.stderr, \
        out.stdout + out.stderr
    after = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    assert after == before

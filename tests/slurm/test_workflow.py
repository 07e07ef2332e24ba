"""The Slurm workflow as users type it, on the real local 2-node cluster (no accounting): plain `sbatch` of every
generated variant, every program form, status/logs/cancel, code snapshots, sweeps as job arrays."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ci_leaves_out

from trainstack._slurm import status
from trainstack._slurm.status import _from_folder, exit_status
from trainstack._slurm.verdict import verdict

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
HERE = Path(__file__).parent
HELLO, ARGS, SLEEPER, SLOW_TRAIN = (str(HERE / n) for n in ("_hello.py", "_args.py", "_sleeper.py",
                                                            "_slow_train.py"))
REAL_ACCELERATE = str(HERE / "_real_accelerate.py")
VENV = str(Path(sys.executable).parents[1])
REPO = HERE.parents[1]
JOB = "trainstack-test"  # every job of these tests has this name: the conftest cancels leftovers by it
CASES = {"single-gpu": (1, 1), "multi-gpu": (1, 2), "multi-node": (2, 2)}

STANDIN_APPTAINER = """#!/bin/bash
# Stand-in for `apptainer exec [--nv] [--bind SRC[:DST]]... IMAGE COMMAND...` on a machine without apptainer:
# checks the call has that shape and the image exists, then runs COMMAND here, marked as "inside".
[[ "${1:-}" == exec ]] || { echo "stand-in apptainer: only 'exec' is supported, got: $*" >&2; exit 2; }
shift
while [[ "${1:-}" == --* ]]; do
  case "$1" in --bind) shift 2 ;; --nv) shift ;; *) echo "stand-in apptainer: unknown flag $1" >&2; exit 2 ;; esac
done
[[ -f "${1:-}" ]] || { echo "stand-in apptainer: no image ${1:-}" >&2; exit 2; }
shift
export INSIDE_STANDIN_CONTAINER=1
exec "$@"
"""


@pytest.fixture
def env(slurm_env, shared_tmp):
    """The job environment: the venv's python first, this checkout importable, a private submission index."""
    e = dict(slurm_env)
    e["PATH"] = f"{VENV}/bin:{e['PATH']}"
    e["PYTHONPATH"] = str(REPO)
    e["XDG_STATE_HOME"] = str(shared_tmp / "state")
    e.pop("TRAINSTACK_SNAPSHOT", None)
    return e


def ts(env: dict, *args: str, cwd: Path | None = None, check: bool = True,
       timeout: float = 120) -> subprocess.CompletedProcess:
    """The `trainstack` command as a user runs it."""
    proc = subprocess.run([sys.executable, "-m", "trainstack", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"trainstack {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def job_id_of(out: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith("job "))
    return line.split()[1]


def status_rows(env: dict, job_id: str) -> list[dict]:
    return json.loads(ts(env, "status", "--json", job_id).stdout)


class RequeueHolds:
    """trainstack's own release of a requeued job's hold (what `submit --wait` does), for tests that follow jobs
    themselves: Slurm's ~2 min delay is not what they test."""

    def __init__(self, env: dict) -> None:
        os.environ.setdefault("SLURM_CONF", env["SLURM_CONF"])  # the product's scontrol calls read the environment
        self.holds = status.RequeueHolds()

    def release(self, job_ids: list[str]) -> None:
        for job in job_ids:
            self.holds.release(job)


def wait_ended(env: dict, job_ids: list[str], timeout: float = 240,
               release_holds: bool = False) -> dict[str, list[dict]]:
    deadline = time.monotonic() + timeout
    holds = RequeueHolds(env) if release_holds else None
    while True:
        if holds is not None:
            holds.release(job_ids)
        rows = {j: status_rows(env, j) for j in job_ids}
        ended = {j: all(r["state"].split(" ")[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "ENDED",
                                                     "NEVER", "NODE_FAIL", "OUT_OF_MEMORY") for r in rs)
                 for j, rs in rows.items()}
        if all(ended.values()):
            return rows
        assert time.monotonic() < deadline, f"jobs still running after {timeout}s: {rows}"
        time.sleep(1.0)


def wait_for_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------- plain sbatch
def _variant_args(setup: str, launcher: str, container: str, image: Path) -> tuple[list[str], int]:
    nodes, procs = CASES[setup]
    world = nodes * procs
    args = ["--setup", setup, "--launcher", launcher, "--cpu", "--nodes", str(nodes), "--procs-per-node",
            str(procs), "--time", "5", "--job-name", JOB]
    if container == "apptainer":
        args += ["--container", "apptainer", "--image", str(image), "--bind", "/tmp:/tmp"]
    if launcher == "custom":  # a launcher of the user's own, here torchrun written out with the placeholders
        args += ["--command", f"{sys.executable} -m torch.distributed.run --nnodes {{num_machines}} "
                              f"--nproc-per-node {procs} --node-rank {{machine_rank}} --master-addr "
                              f"{{main_process_ip}} --master-port {{main_process_port}} {HELLO} {world}"]
        return args, world
    return [*args, "--", HELLO, str(world), "--lr", "1", "a b", "$(touch pwned)"], world


# every launcher on two nodes, each setup once, the container with a task per rank and per node; the whole matrix
# renders to the plan build_plan gives (tests/test_render.py) and the driver's launch of it is unit-tested
VARIANTS = [("multi-node", launcher, "none") for launcher in ("srun", "torchrun", "spawn", "custom")] + \
           [("single-gpu", "srun", "none"), ("multi-gpu", "torchrun", "none"), ("multi-gpu", "spawn", "none")] + \
           [("multi-node", launcher, "apptainer") for launcher in ("srun", "custom")]
# CI (2 cores, the 40-minute line) runs what only this test runs -- a launcher of the user's own and the container,
# through plain sbatch; the built-in launchers' scripts train on real Slurm in test_generated_scripts.py as well
IN_CI = [v for v in VARIANTS if "custom" in v or "apptainer" in v]


@pytest.mark.timeout(900)
def test_plain_sbatch_runs_every_generated_variant(env, shared_tmp):
    """`trainstack generate -o` then plain `sbatch --wait`: the log folder exists, each rank runs, each rank's
    output is in its own file in the job folder, arguments arrive intact."""
    bin_dir = shared_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STANDIN_APPTAINER)
    (bin_dir / "apptainer").chmod(0o755)
    image = shared_tmp / "image.sif"
    image.write_text("stand-in image")
    env = {**env, "PATH": f"{bin_dir}:{env['PATH']}"}
    runs = []
    for setup, launcher, container in IN_CI if os.environ.get("CI") == "true" else VARIANTS:
        folder = shared_tmp / f"{setup}-{launcher}-{container}"
        (folder / "out").mkdir(parents=True)
        args, world = _variant_args(setup, launcher, container, image)
        made = ts(env, "generate", "-o", str(folder / "job.sbatch"), "--log-dir", str(folder / "logs"), *args,
                  cwd=folder)
        assert "created the log folder" in made.stderr and (folder / "logs").is_dir()
        proc = subprocess.Popen(["sbatch", "--wait", "--parsable", str(folder / "job.sbatch")], cwd=folder,
                                env={**env, "PROBE_OUT": str(folder / "out")}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        runs.append((setup, launcher, container, world, folder, proc))
    failures = []
    for setup, launcher, container, world, folder, proc in runs:
        out, err = proc.communicate(timeout=800)
        name = f"{setup}/{launcher}/{container}"
        logs = "".join(p.read_text(errors="replace") for p in (folder / "logs").glob("*.out"))
        if proc.returncode != 0:
            failures.append(f"{name}: sbatch --wait exit {proc.returncode} {err}\n{logs[-3000:]}")
            continue
        records = [json.loads(p.read_text()) for p in sorted((folder / "out").glob("rank*.json"))]
        job_dir = next(p for p in (folder / "logs").glob(f"{JOB}-*") if p.is_dir())
        problems = []
        if sorted(r["rank"] for r in records) != list(range(world)) or {r["sum"] for r in records} != \
                {float(sum(range(world)))}:
            problems.append(f"ranks {records}")
        if launcher != "custom" and any(r["argv"][1:] != ["--lr", "1", "a b", "$(touch pwned)"] for r in records):
            problems.append(f"argv {[r['argv'] for r in records]}")
        if (folder / "pwned").exists():
            problems.append("an argument was executed")
        if container == "apptainer" and any(r["container"] != "1" for r in records):
            problems.append("did not run through the container")
        for rank in range(world):
            rank_log = job_dir / f"rank-{rank}.out"
            if not rank_log.exists() or f"hello from rank {rank} of {world}" not in rank_log.read_text():
                problems.append(f"rank-{rank}.out missing or incomplete: {sorted(p.name for p in job_dir.iterdir())}")
        if launcher == "custom" and not (job_dir / "node-0.out").exists():
            problems.append("node-0.out missing")
        if not (job_dir / "job.sbatch").exists() or (job_dir / "exit_code").read_text().strip() != "0":
            problems.append("job folder incomplete")
        if problems:
            failures.append(f"{name}: {problems}\n{logs[-2000:]}")
    assert not failures, "\n\n".join(failures)


# --------------------------------------------------------------------------------------------- program forms
FORMS = [
    ("script", [], ["ARGS", "--lr", "1", "a b"], {"script": "_args.py"}),
    ("python script", [], ["python", "ARGS", "--lr", "1"], {"script": "_args.py"}),
    ("python3 -u script", [], ["python3", "-u", "ARGS", "--x"], {"script": "_args.py"}),
    ("-m module", [], ["-m", "formpkg.mod", "--lr", "1"], {"module": "formpkg.mod"}),
    ("python -m module", [], ["python", "-m", "formpkg.mod", "--y", "2"], {"module": "formpkg.mod"}),
    ("./executable", [], ["./run.sh", "--lr", "1"], {"script": "_args.py"}),
    ("bash script", [], ["bash", "run.sh", "--lr", "1"], {"script": "_args.py"}),
    ("torchrun executable", ["--launcher", "torchrun"], ["./run.sh", "--lr", "1"], {"script": "_args.py"}),
    ("torchrun module", ["--launcher", "torchrun"], ["-m", "formpkg.mod", "--z"], {"module": "formpkg.mod"}),
    ("custom accelerate launch", ["--launcher", "custom"],
     ["accelerate", "launch", "--cpu", "--num_processes", "{num_processes}", "--num_machines", "{num_machines}",
      "--machine_rank", "{machine_rank}", "--main_process_ip", "{main_process_ip}", "--main_process_port",
      "{main_process_port}", "ARGS", "--lr", "1"], {"script": "_args.py"}),
]


@ci_leaves_out("each program form's words: tests/test_render.py; plain sbatch of every variant runs here")
@pytest.mark.timeout(600)
def test_every_program_form_runs_with_its_arguments(env, shared_tmp):
    work = shared_tmp / "forms"
    (work / "formpkg").mkdir(parents=True)
    shutil.copy(ARGS, work / "_args.py")
    (work / "formpkg" / "__init__.py").write_text("")
    shutil.copy(ARGS, work / "formpkg" / "mod.py")
    (work / "run.sh").write_text(f'#!/bin/bash\nexec {sys.executable} "$(dirname "$0")/_args.py" "$@"\n')
    (work / "run.sh").chmod(0o755)
    jobs = []
    for name, options, words, expect in FORMS:
        out = work / name.replace(" ", "_").replace("/", "")
        out.mkdir()
        program = [w.replace("ARGS", "_args.py") for w in words]
        submitted = ts({**env, "PROBE_OUT": str(out)}, "submit", "--cpu", "--time", "5", "--job-name", JOB,
                       "--log-dir", str(work / "logs"), *options, "--", *program, cwd=work)
        jobs.append((name, job_id_of(submitted.stdout), out, expect))
    states = wait_ended(env, [j for _, j, *_ in jobs])
    failures = []
    for name, job_id, out, expect in jobs:
        if states[job_id][0]["state"] != "COMPLETED" or not (out / "args.json").exists():
            log = ts(env, "logs", job_id, check=False)
            failures.append(f"{name}: {states[job_id]} {log.stdout[-1500:]} {log.stderr}")
            continue
        record = json.loads((out / "args.json").read_text())
        words = dict((n, w) for n, _, w, _ in FORMS)[name]
        wanted = words[words.index("ARGS") + 1:] if "ARGS" in words else \
            words[words.index("formpkg.mod") + 1:] if "formpkg.mod" in words else \
            words[2:] if words[0] == "bash" else words[1:]
        if record["argv"] != wanted or any(record[k] != v for k, v in expect.items()):
            failures.append(f"{name}: got {record}, wanted argv {wanted} and {expect}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(400)
def test_real_accelerate_trains_on_two_nodes_under_the_custom_launcher(env, shared_tmp):
    """The real `accelerate` package (trainstack installed beside it changes nothing): `accelerate launch` with
    trainstack's placeholders on 2 Slurm nodes, one process each, DDP in step. (`--multi_gpu` is accelerate's
    torchrun-based launcher; the script's Accelerator(cpu=True) trains on gloo. `accelerate launch --cpu` would
    need mpirun for more than one process.)"""
    work = shared_tmp / "real-accelerate"
    work.mkdir()
    submitted = ts({**env, "PROBE_OUT": str(work)}, "submit", "--cpu", "--time", "5", "--job-name", JOB,
                   "--setup", "multi-node", "--nodes", "2", "--procs-per-node", "1", "--log-dir", str(work / "logs"),
                   "--launcher", "custom", "--",
                   "accelerate", "launch", "--multi_gpu", "--num_processes", "{num_processes}", "--num_machines",
                   "{num_machines}", "--machine_rank", "{machine_rank}", "--main_process_ip", "{main_process_ip}",
                   "--main_process_port", "{main_process_port}", REAL_ACCELERATE, cwd=work)
    job_id = job_id_of(submitted.stdout)
    state = wait_ended(env, [job_id])[job_id][0]["state"]
    log = ts(env, "logs", job_id, check=False).stdout
    assert state == "COMPLETED" and (work / "accelerate.json").exists(), f"{state}\n{log[-3000:]}"
    record = json.loads((work / "accelerate.json").read_text())
    assert record["module"] == "accelerate.accelerator" and record["processes"] == 2, record
    assert record["ranks"] == [0, 1] and record["same_weights"] and record["batches"] == 4, record
    assert "MULTI_CPU" in record["type"], record


# --------------------------------------------------------------------------------------------- status/logs/cancel
@pytest.mark.timeout(400)
def test_status_logs_cancel_on_running_pending_finished_and_unknown_jobs(env, shared_tmp):
    work = shared_tmp / "status"
    work.mkdir()
    common = ["submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs")]
    ids = {}
    for kind, args in (("finished", ["--", SLEEPER, "0"]), ("running", ["--requeue", "--", SLEEPER, "300"]),
                       ("pending", ["--hold", "--", SLEEPER, "1"])):
        (work / kind).mkdir()
        ids[kind] = job_id_of(ts({**env, "PROBE_OUT": str(work / kind)}, *common, *args, cwd=work).stdout)
    finished, running, pending = ids["finished"], ids["running"], ids["pending"]

    # running: state, the last metric line, the combined and the per-rank log, then cancel (not requeued)
    wait_for_file(work / "running" / "ready")
    time.sleep(1)
    row = status_rows(env, running)[0]
    assert row["state"] == "RUNNING" and row["metric"] == "Iteration      2 | train_loss: 0.2500000", row
    assert "Iteration      2" in ts(env, "logs", running).stdout
    assert "Iteration      1" in ts(env, "logs", running, "--rank", "0").stdout
    missing = ts(env, "logs", running, "--rank", "7", check=False)
    assert missing.returncode == 1 and "no log for rank 7" in missing.stderr and "rank-0" in missing.stderr
    table = ts(env, "status").stdout
    assert running in table and "RUNNING" in table and "LAST METRIC" in table.splitlines()[0]
    assert f"cancelled {running}" in ts(env, "cancel", running).stdout

    # pending: held, no log yet, cancellable
    row = status_rows(env, pending)[0]
    assert row["state"] == "PENDING (JobHeldUser)", row
    early = ts(env, "logs", pending, check=False)
    assert early.returncode == 1 and "has not started" in early.stderr
    ts(env, "cancel", pending)

    # finished: completed, its log readable, nothing to cancel
    states = wait_ended(env, [finished, running, pending])
    assert states[finished][0]["state"] == "COMPLETED"
    assert states[running][0]["state"].startswith("CANCELLED"), states[running]
    assert states[pending][0]["state"].startswith("CANCELLED"), states[pending]
    time.sleep(3)
    assert status_rows(env, running)[0]["restarts"] == 0  # cancelled, not requeued
    assert "slept" in ts(env, "logs", finished).stdout
    # wait and logs -f exit with the job's status (UX review 4: logs -f of a FAILED job exited 0)
    done = ts(env, "wait", finished)
    assert done.returncode == 0 and "COMPLETED" in done.stdout, done
    assert ts(env, "wait", running, check=False).returncode != 0
    assert ts(env, "logs", "-f", running, check=False).returncode != 0
    again = ts(env, "cancel", finished, check=False)
    assert again.returncode == 1 and "not queued or running (COMPLETED)" in again.stderr

    # unknown and malformed ids: a clear answer, never a traceback
    for command in ("status", "logs", "cancel"):
        unknown = ts(env, command, "987654", check=False)
        assert unknown.returncode == 1 and "987654" in unknown.stderr and "unknown" in unknown.stderr, unknown
        assert "Traceback" not in unknown.stderr
        bad = ts(env, command, "12ab", check=False)
        assert bad.returncode == 1 and "is not a Slurm job id" in bad.stderr and "Traceback" not in bad.stderr

    # once Slurm forgets the finished job (MinJobAge), the job folder still answers
    deadline = time.monotonic() + 150
    while subprocess.run(["scontrol", "show", "job", finished], env=env, capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "slurmctld kept the finished job past MinJobAge"
        time.sleep(2)
    row = status_rows(env, finished)[0]
    assert row["state"] == "COMPLETED" and row["source"] == "folder" and row["metric"].startswith("Iteration"), row
    assert "slept" in ts(env, "logs", finished).stdout
    assert "not queued or running (COMPLETED)" in ts(env, "cancel", finished, check=False).stderr


@pytest.mark.timeout(180)
def test_a_job_ended_by_plain_scancel_is_never_recorded_as_a_success(env, shared_tmp):
    """The batch shell's EXIT trap ran with the status of the command before the signal (0): the job folder said
    COMPLETED once Slurm forgot a cancelled or timed-out job. Its TERM trap records 143 now."""
    work = shared_tmp / "scancel"
    work.mkdir()
    job = job_id_of(ts({**env, "PROBE_OUT": str(work)}, "submit", "--cpu", "--time", "5", "--job-name", JOB,
                       "--log-dir", str(work / "logs"), "--", SLEEPER, "300", cwd=work).stdout)
    wait_for_file(work / "ready")
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)  # Slurm's own, not trainstack cancel
    code = work / "logs" / f"{JOB}-{job}" / "exit_code"
    wait_for_file(code, timeout=60)
    time.sleep(0.5)
    assert code.read_text().strip() == "143"
    record = {"job_id": job, "name": JOB, "job_dir": str(code.parent), "log_dir": str(work / "logs")}
    [row] = _from_folder(job, record, None)  # what status answers after MinJobAge
    assert row.state.startswith("ENDED (exit 143, SIGTERM") and exit_status(row.state) == 143, row
    assert verdict(row.state, code.parent, row.log).kind == "terminated"


@pytest.mark.timeout(300)
def test_status_shows_progress_and_eta_of_a_running_trainer_job(env, shared_tmp):
    """From the job folder's log only: step/total, throughput and an ETA that counts down while the job runs."""
    work = shared_tmp / "progress"
    work.mkdir()
    job = job_id_of(ts(env, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs"),
                       "--", SLOW_TRAIN, cwd=work).stdout)
    deadline = time.monotonic() + 180
    while not (row := status_rows(env, job)[0]).get("progress") or row["progress"]["step"] < 8:
        assert time.monotonic() < deadline and row["state"] in ("PENDING", "RUNNING") or \
            row["state"].startswith("PENDING"), row
        time.sleep(1)
    first = row["progress"]
    assert first["total_steps"] == 400 and first["rate"].endswith("samples/s") and 0 < first["epoch"] < 1, first
    left = (400 - first["step"]) * 0.25
    assert 0.6 * left < first["eta_s"] + first["age_s"] < 1.6 * left, first  # about the steps left at 0.25 s each
    time.sleep(4)
    later = status_rows(env, job)[0]["progress"]
    assert later["eta_s"] < first["eta_s"], (first, later)  # it counts down
    named = ts(env, "status", job).stdout
    assert f"{job}: " in named and "step " in named and "/400, " in named and " eta 00:0" in named, named
    table = ts(env, "status").stdout
    header = table.splitlines()[0]
    assert "PROGRESS" in header and any(job in line and "% eta 00:0" in line for line in table.splitlines()), table
    ts(env, "cancel", job)
    wait_ended(env, [job])
    assert status_rows(env, job)[0]["progress"] is None  # an ended job has no ETA


# --------------------------------------------------------------------------------------------- snapshots
SNAPSHOT_PROGRAM = """import os, sys
from pathlib import Path
import helper
out = Path(os.environ["PROBE_OUT"])
restart = os.environ.get("TRAINSTACK_ATTEMPT", "0")
(out / f"run-{restart}.txt").write_text(helper.VERSION + " " + Path("data/input.txt").read_text())
print("ran version", helper.VERSION, "restart", restart, flush=True)
sys.exit(3 if restart == "0" else 0)  # crash once: the retry must run the same snapshot
"""


@pytest.mark.timeout(300)
def test_snapshot_runs_the_submitted_code_even_after_edits_and_a_retry(env, shared_tmp):
    repo = shared_tmp / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "train.py").write_text(SNAPSHOT_PROGRAM)
    (repo / "helper.py").write_text('VERSION = "old"\n')
    (repo / ".gitignore").write_text("data/\nlogs/\n")
    (repo / "data" / "input.txt").write_text("data-from-the-submit-folder")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (repo / "helper.py").write_text('VERSION = "submitted"\n')  # uncommitted, but part of what is submitted
    out = shared_tmp / "snap-out"
    out.mkdir()
    started = time.monotonic()
    sub = ts({**env, "PROBE_OUT": str(out)}, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--hold",
             "--requeue", "--max-requeues", "2", "--retry-on", "exited", "--", "train.py", cwd=repo)
    submit_s = time.monotonic() - started
    assert "warning: the job runs uncommitted changes" in sub.stderr and "helper.py" in sub.stderr
    job_id = job_id_of(sub.stdout)
    (repo / "helper.py").write_text('VERSION = "edited-while-queued"\n')
    (repo / "train.py").write_text("raise SystemExit('the live file ran, not the snapshot')\n")
    subprocess.run(["scontrol", "release", job_id], env=env, check=True)
    deadline, holds = time.monotonic() + 200, RequeueHolds(env)
    while not (out / "run-1.txt").exists():
        assert time.monotonic() < deadline, ts(env, "logs", job_id, check=False).stdout
        holds.release([job_id])  # the requeue is what is tested, not Slurm's delay before it
        time.sleep(0.5)
    assert (out / "run-0.txt").read_text() == "submitted data-from-the-submit-folder"
    assert (out / "run-1.txt").read_text() == "submitted data-from-the-submit-folder"  # the retry too
    states = wait_ended(env, [job_id])
    assert states[job_id][0]["state"] == "COMPLETED" and states[job_id][0]["restarts"] == 0  # retried in place
    job_dir = Path(states[job_id][0]["folder"])
    meta = json.loads((job_dir / "metadata.json").read_text())
    assert meta["git"]["dirty"] is True and len(meta["git"]["commit"]) == 40 and "helper.py" in meta["git"]["changed"]
    assert meta["versions"]["torch"] and meta["argv"][-1] == "train.py" and meta["snapshot"]["files"] == 3
    assert (job_dir / "code" / "helper.py").read_text() == 'VERSION = "submitted"\n'
    print(f"submit with snapshot: {submit_s:.2f}s, snapshot {meta['snapshot']}")


# --------------------------------------------------------------------------------------------- sweeps
SWEEP_PROGRAM = """import argparse, json, os
from pathlib import Path
import torch
from torch import nn
from trainstack import TrainConfig, Trainer
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("--seed", type=int)
args = parser.parse_args()
torch.manual_seed(args.seed)
x = torch.randn(32, 3)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
model = nn.Linear(3, 1)
config = TrainConfig(max_iter=2, verbose=False, resume="auto", compute_setup="cpu")
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=args.lr), config)
trainer.fit(data)
weights = [round(v, 6) for v in model.weight.detach().flatten().tolist()]
(trainer.run_folder / "result.json").write_text(json.dumps({"lr": args.lr, "seed": args.seed, "weights": weights}))
"""


@pytest.mark.timeout(400)
def test_sweep_is_one_array_job_and_resubmitting_runs_only_what_is_left(env, shared_tmp):
    work = shared_tmp / "sweep"
    work.mkdir()
    (work / "sweep_train.py").write_text(SWEEP_PROGRAM)
    sweep = ["--sweep", "lr=0.1,0.05", "--sweep", "seed=0,1", "--max-parallel", "2"]
    common = ["submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs"), *sweep]
    dry = ts(env, *common, "--dry-run", "--", "sweep_train.py", cwd=work)
    assert "#SBATCH --array=0-3%2" in dry.stdout and "4 of 4 task(s) would run" in dry.stderr
    sub = ts(env, *common, "--hold", "--", "sweep_train.py", cwd=work)
    job_id = job_id_of(sub.stdout)
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    assert "ArrayTaskId=0-3%2" in shown and "ArrayTaskThrottle=2" in shown, shown
    subprocess.run(["scontrol", "release", job_id], env=env, check=True)
    rows = wait_ended(env, [job_id])[job_id]
    assert [r["job"] for r in rows] == [f"{job_id}_{i}" for i in range(4)]
    assert all(r["state"] == "COMPLETED" for r in rows), rows
    results = [json.loads(p.read_text()) for p in sorted((work / "logs").glob(f"sweep-{JOB}/*/result.json"))]
    assert sorted((r["lr"], r["seed"]) for r in results) == [(0.05, 0), (0.05, 1), (0.1, 0), (0.1, 1)]
    assert len({json.dumps(r["weights"]) for r in results}) == 4  # four different trainings
    assert "trainstack: sweep task 2 (" in ts(env, "logs", f"{job_id}_2").stdout
    array_logs = ts(env, "logs", job_id, check=False)
    assert array_logs.returncode == 1 and f"{job_id}_0" in array_logs.stderr

    again = ts(env, *common, "--", "sweep_train.py", cwd=work)
    assert "already finished" in again.stdout and "nothing submitted" in again.stdout
    done = next((work / "logs").glob(f"sweep-{JOB}/*/.trainstack-done"))
    done.unlink()  # one task's result lost: only that one runs again
    one = ts(env, *common, "--", "sweep_train.py", cwd=work)
    assert "skipping 3 task(s)" in one.stderr
    rows = wait_ended(env, [job_id_of(one.stdout)])[job_id_of(one.stdout)]
    assert len(rows) == 1 and rows[0]["state"] == "COMPLETED" and done.exists()


@ci_leaves_out("a sweep on real Slurm: test_sweep_is_one_array_job_and_resubmitting_runs_only_what_is_left")
@pytest.mark.timeout(300)
def test_a_sweep_over_a_script_with_its_own_log_folder_trains_every_task(env, shared_tmp):
    """The script sets log_folder (as most do) and resume='auto': each task still trains in its own folder (said
    in its log), every task trains its steps, none 'completes' by resuming another's finished run."""
    work = shared_tmp / "sweep-shared"
    work.mkdir()
    program = SWEEP_PROGRAM.replace('resume="auto",', 'resume="auto", log_folder="runs/shared", seed=args.seed,')
    (work / "sweep_train.py").write_text(program)
    sub = ts(env, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs"), "--sweep",
             "seed=0,1,2", "--max-parallel", "2", "--", "sweep_train.py", "--lr", "0.1", cwd=work)
    job_id = job_id_of(sub.stdout)
    rows = wait_ended(env, [job_id])[job_id]
    assert all(r["state"] == "COMPLETED" for r in rows), rows
    results = [json.loads(p.read_text()) for p in sorted((work / "logs").glob(f"sweep-{JOB}/*/result.json"))]
    assert sorted(r["seed"] for r in results) == [0, 1, 2] and len({json.dumps(r["weights"]) for r in results}) == 3
    assert not (work / "runs" / "shared").exists()
    log = ts(env, "logs", f"{job_id}_1").stdout
    assert "sweep task: training in its own folder" in log and "log_folder='runs/shared'" in log, log


@pytest.mark.timeout(300)
def test_each_sweep_task_is_retried_on_its_own(env, shared_tmp):
    """Task 1 crashes on its first run: only it is retried (a new job step of its own allocation, its own retry
    record), then every task finishes; nothing is requeued."""
    work = shared_tmp / "sweep-requeue"
    work.mkdir()
    (work / "flaky.py").write_text(
        "import os, sys\n"
        "first = os.environ.get('TRAINSTACK_ATTEMPT', '0') == '0'\n"
        "print('task', os.environ['SLURM_ARRAY_TASK_ID'], 'attempt', os.environ.get('TRAINSTACK_ATTEMPT', '0'))\n"
        "sys.exit(3 if first and sys.argv[-1] == 'b' else 0)\n")
    sub = ts(env, "submit", "--cpu", "--time", "5", "--job-name", JOB, "--log-dir", str(work / "logs"),
             "--requeue", "--max-requeues", "1", "--retry-on", "exited", "--sweep", "mode=a,b", "--", "flaky.py",
             cwd=work)
    job_id = job_id_of(sub.stdout)
    rows = wait_ended(env, [job_id])[job_id]
    assert [(r["job"], r["state"], r["restarts"]) for r in rows] == [(f"{job_id}_0", "COMPLETED", 0),
                                                                     (f"{job_id}_1", "COMPLETED", 0)], rows
    log = ts(env, "logs", f"{job_id}_1").stdout
    assert "crash (exit status 3): retrying in this allocation as step 1" in log and "task 1 attempt 1" in log, log
    assert not (Path(rows[0]["folder"]) / ".requeues").exists()

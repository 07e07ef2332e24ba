"""In-allocation recovery on the real local Slurm (node1-3; partition ``spares`` holds all three): a crashed rank is
retried as a new job step of the same allocation, a lost node is replaced by a spare, both bitwise equal to an
uninterrupted run; a deterministic error is not retried; a lost node without a spare continues on the survivor
(--min-nodes); a lost batch host is requeued by the sentinel with Slurm's hold released."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, ci_leaves_out

from trainstack.render import LaunchSpec
from trainstack.submit import submit_spec, wait_for

sys.path.insert(0, str(ROOT / "bench"))
from _faults import (  # noqa: E402
    kill_batch_host,
    kill_node,
    kill_rank,
    rank_pids,
    reached,
    restore_nodes,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]
PROBE = str(Path(__file__).with_name("_recovery_train.py"))
FAULT = str(Path(__file__).with_name("_fault.py"))


def spec(out: Path, launcher: str = "srun", spare: int = 1, requeue: bool = True, step_sleep: float = 0.3,
         program: list[str] | None = None, nodes: int = 2, memory_every: int = 0,
         min_nodes: int | None = None, record_ids: bool = False, strategy: str = "ddp") -> LaunchSpec:
    """4 ranks on 2 nodes (plus ``spare``), partition spares, the recovery program unless ``program``. No node
    check: the faults here hit chosen nodes (node1's rank 1, node2), and the "nodes" of this box share its two cores,
    so a check could leave out the very node a test is about (test_node_health.py tests the check)."""
    return LaunchSpec(setup="multi-node", nodes=nodes, cpu=True, procs_per_node=2, launcher=launcher, time="10",
                      job_name="trainstack-test", log_dir=str(out / "logs"), requeue=requeue, spare_nodes=spare,
                      min_nodes=min_nodes, node_check=False,
                      partition="spares", env={"PROBE_OUT": str(out), "STEP_SLEEP": str(step_sleep),
                                               "MEMORY_EVERY": str(memory_every),
                                               "RECORD_IDS": "1" if record_ids else "0", "STRATEGY": strategy},
                      venv=str(Path(sys.executable).parents[1]), program=program or [PROBE])


def job_field(env: dict, job_id: str, name: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else None


def ts(env: dict, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "trainstack", *args], env=env, capture_output=True, text=True,
                          timeout=60).stdout


def events(job) -> list[dict]:
    path = job.log_path.with_suffix("") / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_step_after(job, when: float) -> float:
    return next(e["time"] for e in events(job) if e["kind"] == "first_step" and e["time"] > when)


def same_parameters(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture
def cluster(slurm_env, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    yield slurm_env
    assert not restore_nodes(slurm_env), "a node killed by the test did not come back"  # for the next test
    subprocess.run(["pkill", "-9", "-f", PROBE], check=False)


@pytest.fixture
def slurm_default_timeout(cluster):
    """Slurm's default SlurmdTimeout (300 s; the test cluster's is 30 s) while the test runs: a job that held a lost
    node until Slurm declared it dead would end minutes after its training, not seconds."""
    conf = Path(cluster["SLURM_CONF"])
    text = conf.read_text()
    conf.write_text(re.sub(r"(?m)^SlurmdTimeout=\d+", "SlurmdTimeout=300", text))
    subprocess.run(["scontrol", "reconfigure"], env=cluster, check=True, timeout=60)
    try:
        yield cluster
    finally:
        assert not restore_nodes(cluster), "a node killed by the test did not come back"
        conf.write_text(text)
        subprocess.run(["scontrol", "reconfigure"], env=cluster, check=True, timeout=60)


_REFERENCE: dict[str, Path] = {}


def reference(tmp_root: Path, launcher: str = "srun", strategy: str = "ddp") -> Path:
    """The uninterrupted run's final parameters, once per session and strategy: srun, torchrun and the spawn
    launcher train this program bitwise alike (their uninterrupted runs were compared), so every launcher's recovery
    is held to the srun run's result."""
    del launcher
    if strategy not in _REFERENCE:
        out = tmp_root / f"reference-{strategy}"
        out.mkdir(mode=0o777)
        job = submit_spec(spec(out, "srun", spare=0, requeue=False, step_sleep=0.02, strategy=strategy), wait=True,
                          timeout=240)
        assert job.exit_code == 0, job.log_path.read_text()
        _REFERENCE[strategy] = out / "final.pt"
    return _REFERENCE[strategy]


def samples_by_step(out: Path) -> dict[int, list[int]]:
    """Each optimizer step's samples over all ranks (ids/<job step>-<attempt>-rank<r>.jsonl); a step redone after a
    recovery counts as the later job step did it (what the crashed step did past its checkpoint was rolled back)."""
    by_step: dict[int, dict[str, list[int]]] = {}
    for path in sorted((out / "ids").glob("*.jsonl"), key=lambda p: [int(x) for x in p.name.split("-")[:2]]
                       if p.name[0].isdigit() else [0, 0]):
        run = "-".join(path.name.split("-")[:2])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], {}).setdefault(run, []).extend(row["ids"])
    return {step: sorted(runs[list(runs)[-1]]) for step, runs in sorted(by_step.items())}


def shrunk_reference(root: Path, at_step: int) -> Path:
    """An unfaulted run that makes the same change from the same checkpoint: 4 processes under torchrun stop
    gracefully at ``at_step``, then 2 continue with the planned world of 4 (what the driver sets on a shrunk step)."""
    out = root / f"shrunk-reference-{at_step}"
    if (out / "final.pt").exists():
        return out
    out.mkdir(mode=0o777)
    env = {**os.environ, "PROBE_OUT": str(out), "STEP_SLEEP": "0", "RECORD_IDS": "1"}
    for k in [k for k in env if k.startswith(("SLURM_", "TRAINSTACK_"))]:
        del env[k]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    for nprocs, extra in ((4, {"STOP_AT": str(at_step)}), (2, {"TRAINSTACK_PLANNED_WORLD": "4"})):
        (out / "STOP").unlink(missing_ok=True)
        proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", str(nprocs), PROBE], env=env | extra,
                              capture_output=True, text=True, timeout=150, start_new_session=True)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    root.chmod(0o777)
    return root


@ci_leaves_out("a crash in the allocation: the in-place test under srun; torchrun's launch words: test_allocation.py")
def test_a_killed_rank_resumes_in_the_allocation_bitwise(cluster, tmp_root):
    """SIGKILL of rank 1 mid-epoch under torchrun: a new step of the same allocation (Restarts=0) with a rendezvous
    of its own -- its four ranks warm standbys in torchrun's worker form --, resumed from the last checkpoint, the
    final parameters bitwise equal to the uninterrupted run's; status/why show the phases."""
    ref = reference(tmp_root, "torchrun")
    out = tmp_root / "crash"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, "torchrun"))
    standbys = job.log_path.with_suffix("") / "standby"
    wait_until(lambda: reached(out) >= 22 and all(len(list(standbys.glob(f"*-{h}-*.ready"))) >= 2
                                                  for h in ("node1", "node2")), 120, "step 22 and warm standbys")
    killed = kill_rank(out, "node1", 1)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "rank(s) 0, 1, 2, 3 start in warm standby process(es)" in log, log  # issue 68: torchrun's ranks warm
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)
    assert "retrying in this allocation as step 1" in log and "requeueing" not in log, log
    resumed = first_step_after(job, killed) - killed
    print(f"crash -> first resumed step {resumed:.1f} s")
    assert resumed <= 30, resumed  # a sanity bound: the figure is make bench-recovery's
    assert same_parameters(out / "final.pt", ref)
    attempts = ts(cluster, "status", "--attempts", job.job_id)
    assert "killed (signal 9)" in attempts and "recovered in the allocation" in attempts, attempts
    assert re.search(r"detect [\d.]+ s, teardown [\d.]+ s, relaunch [\d.]+ s, restore [\d.]+ s, first step", attempts)
    found = json.loads(ts(cluster, "why", "--json", job.job_id))
    (rec,) = found["recoveries"]
    assert rec["where"] == "in allocation" and rec["resumed_at"] % 5 == 0 and 0 <= rec["steps_lost"] <= 5 + 5, rec


def test_a_killed_rank_restarts_alone_and_the_others_continue_in_place_bitwise(cluster, tmp_root):
    """srun, rank 1 SIGKILLed: ranks 0, 2, 3 keep their processes (the same pids train the rest), join job step 1's
    process group and continue from the last step they completed -- no checkpoint read (one every 5 steps), no step
    redone (issue 67): the new rank 1 on node1 takes that state from rank 0. Restarts=0, every step trained once
    (rank 0's own records), the final parameters bitwise equal to the uninterrupted run's, the recovery's phases
    recorded as any retry's."""
    ref = reference(tmp_root)
    out = tmp_root / "in-place"
    out.mkdir(mode=0o777)
    umask = os.umask(0o002)  # a group project space (probe 5): the job and its ranks run with it too
    try:
        job = submit_spec(spec(out, "srun", spare=0, record_ids=True))
    finally:
        os.umask(umask)
    standbys = job.log_path.with_suffix("") / "standby"
    wait_until(lambda: reached(out) >= 22 and len(list((out / "pids").glob("*"))) == 4 and
               any(standbys.glob("*-node1-*.ready")), 120, "step 22 and a warm standby on node1")
    planted = _plant_as_group_member(job.log_path.with_suffix(""))
    before = {p.name: p.read_text().split()[0] for p in (out / "pids").glob("*")}
    killed = kill_rank(out, "node1", 1)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "rank(s) 0, 2, 3 continue in place; starting rank(s) 1 on node1" in log, log
    after = {p.name: p.read_text().split() for p in (out / "pids").glob("*")}
    (warm,) = [e for e in events(job) if e["kind"] == "standby_taken"]  # issue 68: rank 1 in a warm standby
    assert warm["ranks"] == {"1": int(after["node1-1"][0])} and warm["ready_since"] < killed, warm
    assert f"rank(s) 1 start in warm standby process(es) {after['node1-1'][0]} on node1" in log, log
    wait_until(lambda: not _standbys_of(job.job_id), 30, "the job's standbys to end")  # none outlives its job
    assert {name: pid for name, (pid, step) in after.items()} == {**before, "node1-1": after["node1-1"][0]} and \
        after["node1-1"][0] != before["node1-1"], (before, after)
    assert all(step == "1" for _, step in after.values()), after  # every rank trained on in job step 1
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)
    print(f"in place: crash -> first resumed step {first_step_after(job, killed) - killed:.1f} s")
    assert same_parameters(out / "final.pt", ref)
    (rec,) = json.loads(ts(cluster, "why", "--json", job.job_id))["recoveries"]
    assert rec["where"] == "in allocation" and rec["steps_lost"] == 0, rec
    (sent,) = [e for e in events(job) if e["kind"] == "peer_state"]  # the new rank's state came from a survivor
    assert sent["receivers"] == [1] and sent["source_rank"] == 0 and sent["bytes"] > 0, sent
    (resumed,) = [e for e in events(job) if e["kind"] == "resumed"]
    assert resumed["origin"] == "live" and resumed["step"] == sent["step"], resumed  # no checkpoint read
    steps = [json.loads(line)["step"] for f in sorted((out / "ids").glob("*-rank0.jsonl"))
             for line in f.read_text().splitlines()]
    assert sorted(steps) == list(range(1, 61)), steps  # every step once: none trained twice
    print(f"in place: {sent['bytes']} bytes from rank 0 in {sent['seconds']} s, steps redone: 0")
    folder = job.log_path.with_suffix("")  # issue 64: nothing the driver, the ranks or the CLI read back is open
    open_to_others = [str(p) for p in [folder, *folder.rglob("*")] if not p.is_symlink() and p.lstat().st_mode & 0o022]
    assert not open_to_others and (folder / "rejoin" / "joined-1-rank-0").is_file(), open_to_others
    assert planted == [], planted  # the probe's A3/A28/E2/E32 writes, as a member of the job folder's group


def test_hsdp_a_killed_rank_takes_its_shard_from_the_other_replica_group_bitwise(cluster, tmp_root):
    """HSDP, one replica group per node (2 x 2), rank 1 (node1's group, shard 1) SIGKILLed: ranks 0, 2, 3 keep their
    processes -- rank 2, blocked in a collective with rank 0 rather than with the dead rank, fails too once the
    survivors close their failed groups' connections --, shard their models again over job step 1's mesh from their
    own local shards, and the new rank 1 takes shard 1 from rank 3 (node2's group): no checkpoint read, no step
    redone, every step trained once, the final parameters bitwise equal to the uninterrupted HSDP run's (issue 67)."""
    ref = reference(tmp_root, strategy="hsdp")
    out = tmp_root / "hsdp-in-place"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, "srun", spare=0, record_ids=True, strategy="hsdp"))
    standbys = job.log_path.with_suffix("") / "standby"
    wait_until(lambda: reached(out) >= 22 and len(list((out / "pids").glob("*"))) == 4 and
               any(standbys.glob("*-node1-*.ready")), 120, "step 22 and a warm standby on node1")
    before = {p.name: p.read_text().split()[0] for p in (out / "pids").glob("*")}
    killed = kill_rank(out, "node1", 1)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "rank(s) 0, 2, 3 continue in place; starting rank(s) 1 on node1" in log, log
    after = {p.name: p.read_text().split()[0] for p in (out / "pids").glob("*")}
    assert {k: v for k, v in after.items() if k != "node1-1"} == {k: v for k, v in before.items() if k != "node1-1"}
    print(f"hsdp in place: crash -> first resumed step {first_step_after(job, killed) - killed:.1f} s")
    assert same_parameters(out / "final.pt", ref)
    (rec,) = json.loads(ts(cluster, "why", "--json", job.job_id))["recoveries"]
    assert rec["where"] == "in allocation" and rec["steps_lost"] == 0, rec
    (sent,) = [e for e in events(job) if e["kind"] == "peer_state"]
    assert sent["receivers"] == [1] and sent["sources"] == {"1": 3} and sent["bytes"] > 0, sent
    (resumed,) = [e for e in events(job) if e["kind"] == "resumed"]
    assert resumed["origin"] == "live" and resumed["step"] == sent["step"], resumed
    steps = [json.loads(line)["step"] for f in sorted((out / "ids").glob("*-rank0.jsonl"))
             for line in f.read_text().splitlines()]
    assert sorted(steps) == list(range(1, 61)), steps
    print(f"hsdp in place: {sent['bytes']} bytes from rank 3 in {sent['seconds']} s, steps redone: 0")


@ci_leaves_out("a whole-step relaunch in standbys: test_allocation.py; the warm path on real Slurm: the in-place "
               "test")
def test_a_whole_step_relaunch_takes_every_rank_from_warm_standbys_bitwise(cluster, tmp_root):
    """TRAINSTACK_IN_PLACE=0 (what FSDP, HSDP or an NCCL group without an abort do) and TRAINSTACK_STANDBY=2: rank 1
    SIGKILLed, every rank of the step is relaunched -- all four in standbys that were ready before the fault (new
    pids, each named in the timeline) -- resumed from the last checkpoint, bitwise."""
    ref = reference(tmp_root)
    out = tmp_root / "whole-step"
    out.mkdir(mode=0o777)
    launch = spec(out, "srun", spare=0)
    launch.env.update({"TRAINSTACK_IN_PLACE": "0", "TRAINSTACK_STANDBY": "2"})
    job = submit_spec(launch)
    standbys = job.log_path.with_suffix("") / "standby"
    wait_until(lambda: reached(out) >= 22 and len(list((out / "pids").glob("*"))) == 4 and
               all(len(list(standbys.glob(f"*-{h}-*.ready"))) >= 2 for h in ("node1", "node2")), 120,
               "step 22 and two warm standbys on each node")
    before = {p.name: p.read_text().split()[0] for p in (out / "pids").glob("*")}
    killed = kill_rank(out, "node1", 1)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    after = {p.name: p.read_text().split()[0] for p in (out / "pids").glob("*")}
    (warm,) = [e for e in events(job) if e["kind"] == "standby_taken"]
    assert {int(r): pid for r, pid in warm["ranks"].items()} == \
        {int(name.rsplit("-", 1)[1]): int(pid) for name, pid in after.items()}, (warm, after)
    assert warm["ready_since"] < killed and not set(before.values()) & set(after.values()), (before, after)
    print(f"whole-step relaunch in standbys: crash -> first resumed step "
          f"{first_step_after(job, killed) - killed:.1f} s")
    assert same_parameters(out / "final.pt", ref)
    wait_until(lambda: not _standbys_of(job.job_id), 30, "the job's standbys to end")


def _standbys_of(job_id: str) -> list[int]:
    """The warm standby processes of job ``job_id`` still running on this box (every node of the test cluster)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"trainstack._runtime.standby" in (proc / "cmdline").read_bytes() and \
                    f"SLURM_JOB_ID={job_id}\0".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@ci_leaves_out("a standby that fails: test_allocation.py's broken and silent standbys; the warm path: the in-place "
               "test")
def test_a_killed_standby_never_blocks_a_recovery(cluster, tmp_root):
    """node1's ready standby SIGKILLed, then rank 1 at once: the crash recovers all the same -- rank 1 starts afresh
    (no standby ready there yet) or, where the driver ordered the dead one before it saw it end, after its order
    went unanswered -- said, bitwise, and the job's end leaves no standby behind."""
    ref = reference(tmp_root)
    out = tmp_root / "killed-standby"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, "srun", spare=0))
    standbys = job.log_path.with_suffix("") / "standby"
    wait_until(lambda: reached(out) >= 22 and len(list((out / "pids").glob("*"))) == 4 and
               any(standbys.glob("*-node1-*.ready")), 120, "step 22 and a warm standby on node1")
    ready = next(standbys.glob("*-node1-*.ready"))
    os.kill(int(ready.read_text().split()[1]), signal.SIGKILL)
    kill_rank(out, "node1", 1)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "warm standby(s) ready on node1 for its 1 rank(s): the step's ranks start afresh" in log or \
        "did not take the order within 2 s: starting them afresh" in log, log
    assert same_parameters(out / "final.pt", ref)
    wait_until(lambda: not _standbys_of(job.job_id), 30, "the job's standbys to end")


def _plant_as_group_member(folder: Path) -> list[str]:
    """What another user of the job folder's group could write in it (probe 5's attacker): each path written."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    script = ('cd "$1"; for f in rejoin/step-99.json peers-lost/rank-0 exits/rank-1 memory-folders events.jsonl '
              '.stop; do mkdir -p "$(dirname "$f")" 2>/dev/null; echo forged >> "$f" 2>/dev/null && echo "$f"; done')
    done = subprocess.run(["setpriv", "--reuid=65534", f"--regid={folder.stat().st_gid}", "--clear-groups", "bash",
                           "-c", script, "_", str(folder)], capture_output=True, text=True, timeout=30)
    return done.stdout.split()


def _driver_pid(job_id: str) -> int | None:
    """The allocation driver of job ``job_id``: the child of the keeper (both run trainstack._slurm.allocation)."""
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or b"trainstack._slurm.allocation" not in (proc / "cmdline").read_bytes():
                continue
            if f"SLURM_JOB_ID={job_id}\0".encode() not in (proc / "environ").read_bytes():
                continue
            found[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return next((pid for pid, parent in found.items() if parent in found), None)


def test_a_killed_driver_is_replaced_in_the_allocation_bitwise(cluster, tmp_root):
    """Issue 66 (probe 5 A23): the allocation driver SIGKILLed mid-run -- the job does not end with it: its keeper
    says so, kills the steps it left, and a new driver takes over the same allocation from the newest checkpoint;
    every step is done, the final parameters bitwise equal to an uninterrupted run's, the attempt named."""
    ref = reference(tmp_root)
    out = tmp_root / "driver"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, "srun", spare=0))
    wait_until(lambda: reached(out) >= 12 and _driver_pid(job.job_id) is not None, 120, "step 12")
    killed = time.time()
    os.kill(_driver_pid(job.job_id), signal.SIGKILL)
    assert wait_for(job, timeout=240) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "the allocation driver died (killed by SIGKILL) without ending the job" in log, log
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)
    assert same_parameters(out / "final.pt", ref)
    print(f"driver killed -> first resumed step {first_step_after(job, killed) - killed:.1f} s")
    attempts = ts(cluster, "status", "--attempts", job.job_id)
    assert "driver died: killed by SIGKILL" in attempts, attempts


def memory_folders(job_id: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"trainstack-*/job-{job_id}-*"))


# srun here (a task per rank, with memory checkpoints); torchrun's relaunch as a new step (a task per node, its
# rendezvous per step) is the killed-rank test's; the launch words per launcher: tests/test_allocation.py
@pytest.mark.parametrize("launcher", ["srun"])
def test_a_lost_node_is_replaced_by_a_spare_bitwise(cluster, slurm_default_timeout, tmp_root, launcher):
    """Every process of the step on node2 and node2's slurmd killed: node3 takes its place in the same
    allocation (node2 named and left out), the run ends bitwise equal to the uninterrupted one. Under srun the run
    keeps memory checkpoints, and node2's memory is lost with it: ranks 2, 3 take the survivors' live state (issue
    67: no step redone), not the copies."""
    ref = reference(tmp_root, launcher)
    out = tmp_root / f"lost-{launcher}"
    out.mkdir(mode=0o777)
    memory = launcher == "srun"  # with memory checkpoints every 2 steps (durable every 5): node2's memory is lost too
    job = submit_spec(spec(out, launcher, memory_every=2 if memory else 0))
    # step 23 reached: the memory set of step 22 is complete (newer than the durable checkpoint of step 20)
    wait_until(lambda: reached(out) >= 23 and len(rank_pids(out, "node2")) == 2, 120, "step 23")
    for folder in memory_folders(job.job_id):
        shutil.rmtree(folder / "node2", ignore_errors=True)
    killed = kill_node(out, "node2", Path(cluster["SLURM_CONF"]))
    assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    ended = time.time()
    log = job.log_path.read_text()
    assert "retrying in this allocation as step 1 on node1,node3" in log, log
    # issue 66: the lost node is handed back, so the job ends with its training, not SlurmdTimeout (Slurm's default
    # 300 s here) after it
    assert "handed node2 back to Slurm (lost; the job goes on with node1,node3)" in log, log
    assert not list(Path.cwd().glob(f"slurm_job_{job.job_id}_resize.*"))  # scontrol's scripts: in the job folder
    end_of_training = (out / "final.pt").stat().st_mtime
    print(f"{launcher}: last step -> job ended {ended - end_of_training:.1f} s")
    assert ended - end_of_training <= 20, ended - end_of_training
    resumed = first_step_after(job, killed) - killed
    print(f"{launcher}: node lost -> first resumed step {resumed:.1f} s")
    assert resumed <= 30, resumed
    assert same_parameters(out / "final.pt", ref)
    found = json.loads(ts(cluster, "why", "--json", job.job_id))
    (rec,) = found["recoveries"]
    assert "node lost: node2 (ranks 2, 3 stopped answering" in rec["cause"], rec
    assert rec["nodes"] == "node1,node3", rec
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)
    if memory:  # issue 67: ranks 2, 3 on the spare take rank 0's live state -- not their copies on node1, nor the
        (resumed,) = [e for e in events(job) if e["kind"] == "resumed"]  # durable checkpoint: no step redone
        assert resumed["origin"] == "live" and rec["resumed_from"] == "live state" and rec["steps_lost"] == 0, rec
        assert not memory_folders(job.job_id), "the finished job's memory checkpoints are freed"


def test_the_batch_script_frees_the_memory_of_killed_processes(cluster, tmp_root):
    """No retries: rank 0 SIGKILLed, the job fails, and the batch script frees every node's memory folder."""
    out = tmp_root / "memory-freed"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, spare=0, requeue=False, memory_every=2))
    wait_until(lambda: reached(out) >= 6 and memory_folders(job.job_id), 120, "step 6")
    kill_rank(out, "node1", 0)
    assert wait_for(job, timeout=120) != 0
    assert not memory_folders(job.job_id), "a failed job's memory checkpoints are freed by its batch script"


@ci_leaves_out("freeing memory on real Slurm: the batch script's own test")
def test_memory_a_killed_driver_left_is_freed_by_one_command(cluster, tmp_root):
    """The whole job cancelled with SIGKILL: its driver is killed, or -- where it still runs its end -- can start no
    job step to free the memory checkpoints (it says so and keeps their listing); `trainstack checkpoint free-memory
    JOB` frees them on the job's nodes, that job's folders only."""
    out = tmp_root / "memory-left"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, spare=0, requeue=False, memory_every=2))
    wait_until(lambda: reached(out) >= 6 and memory_folders(job.job_id), 120, "step 6")
    subprocess.run(["scancel", "--full", "--signal=KILL", job.job_id], check=True, timeout=30)
    wait_for(job, timeout=120)
    assert memory_folders(job.job_id), "nothing was left to free: the test would prove nothing"
    said = subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "free-memory", job.job_id], env=cluster,
                          capture_output=True, text=True, timeout=180)
    assert said.returncode == 0 and "freed 1 memory checkpoint folder(s)" in said.stdout, said.stdout + said.stderr
    assert not memory_folders(job.job_id)


@ci_leaves_out("a bug not retried on real Slurm: tests/slurm/test_verdicts.py's retry policy")
def test_a_python_error_is_not_retried(cluster, tmp_root):
    """A deterministic error: one verdict, no second step, no requeue."""
    out = tmp_root / "error"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, program=[FAULT, "error"]))
    assert wait_for(job, timeout=240) != 0
    log = job.log_path.read_text()
    assert "not retried: python error" in log and "as step 1" not in log and "requeueing" not in log, log


ONE_PATH_IN_CI = ci_leaves_out("one launcher on real Slurm: srun")


@pytest.mark.parametrize("launcher", ["srun", pytest.param("torchrun", marks=ONE_PATH_IN_CI)])
def test_a_lost_node_without_a_spare_continues_on_the_survivor(cluster, slurm_default_timeout, tmp_root, launcher):
    """No spare, --min-nodes 1: node2 lost at step ~22, the run continues on node1 with 2 ranks in the same
    allocation (no requeue, Restarts=0), keeping the planned global batch by gradient accumulation -- so it ends at
    the planned step; every step's 16 samples are those of an unfaulted run that made the same change from the same
    checkpoint (every sample once per epoch), and the final parameters equal that run's bit for bit. (The decisions
    around it, min-nodes and the node check: tests/test_allocation.py.)"""
    out = tmp_root / f"shrink-{launcher}"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, launcher, spare=0, min_nodes=1, record_ids=True))
    wait_until(lambda: reached(out) >= 22 and len(rank_pids(out, "node2")) == 2, 120, "step 22")
    killed = kill_node(out, "node2", Path(cluster["SLURM_CONF"]))
    assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    ended_after = time.time() - (out / "final.pt").stat().st_mtime  # node2 handed back: not SlurmdTimeout later
    print(f"no spare: last step -> job ended {ended_after:.1f} s")
    assert ended_after <= 30, ended_after
    log = job.log_path.read_text()
    assert "no spare left (node2 lost): continuing on 1 of 2 nodes (node1)" in log and "requeueing" not in log, log
    resumed = first_step_after(job, killed) - killed
    print(f"no spare: node lost -> continued on node1 -> first resumed step {resumed:.1f} s")
    assert resumed <= 30, resumed
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)
    assert reached(out) == 60  # 4 epochs x 15 steps of 16 samples: the planned run's steps
    ranks = "".join(p.read_text() for p in job.log_path.with_suffix("").rglob("rank-0*.out"))
    assert "running on 2 of the 4 planned processes: gradient_accumulation_steps 1 -> 2" in ranks, ranks[-3000:]
    listed = ts(cluster, "status", "--attempts", job.job_id)
    assert "continued on 1 of 2 nodes (node2 lost), in the allocation on node1" in listed, listed
    at = int(re.findall(r"Resumed from .+? \(epoch \d+, step (\d+);", ranks)[-1])
    if launcher == "srun":  # issue 67: the survivors continue in place from the step they completed, no rollback
        assert "live state" in ranks.split("Resumed from")[-1].split("\n")[0], ranks[-2000:]
    steps, twin = samples_by_step(out), shrunk_reference(tmp_root, at)
    expected = samples_by_step(twin)
    # the step the run continued from was complete -- its gradient all-reduce held node2's ranks' part -- but those
    # ranks may have died before recording it: the survivors' records are a part of the twin's, the rest as they were
    assert set(steps[at]) <= set(expected[at]) and len(steps[at]) in (8, 16), (at, steps[at], expected[at])
    steps[at] = expected[at]
    assert sorted(steps) == list(range(1, 61)) and all(len(ids) == 16 for ids in steps.values())
    for epoch in range(4):  # every sample exactly once per epoch, across the change
        assert sorted(i for s in range(15 * epoch + 1, 15 * epoch + 16) for i in steps[s]) == list(range(240))
    assert steps == expected  # the same samples at every step as the unfaulted change
    assert same_parameters(out / "final.pt", twin / "final.pt")


@ci_leaves_out("a lost node on real Slurm: the spare and shrink tests; silent ranks: tests/test_allocation.py, "
               "tests/test_watchdog.py")
def test_a_frozen_node_is_found_by_the_watchdog_not_slurms_timeout(cluster, tmp_root):
    """node2's ranks stopped (SIGSTOP: their connections stay open, no error reaches their peers) and its slurmd
    killed: rank 0's watchdog names node2's ranks within seconds (not a collective timeout, not SlurmdTimeout),
    ends the step, and a spare takes over; bitwise."""
    ref = reference(tmp_root, "srun")
    out = tmp_root / "frozen"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out))
    wait_until(lambda: reached(out) >= 22 and len(rank_pids(out, "node2")) == 2, 120, "step 22")
    conf = Path(cluster["SLURM_CONF"])
    frozen = time.time()
    for pid in rank_pids(out, "node2"):
        os.kill(pid, signal.SIGSTOP)
    os.kill(int((conf.parent / "slurmd-node2.pid").read_text().strip()), signal.SIGKILL)
    try:
        assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    finally:
        for pid in rank_pids(out, "node2"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = job.log_path.read_text()
    assert re.search(r"ranks? 2(-3)? \(node2\) stopped answering at step \d+: no heartbeat", log), log
    assert "retrying in this allocation as step 1 on node1,node3" in log, log
    resumed = first_step_after(job, frozen) - frozen
    print(f"frozen node -> first resumed step {resumed:.1f} s")
    assert resumed <= 60, resumed  # detection: three watchdog intervals (15 s), then the teardown and the probe
    assert same_parameters(out / "final.pt", ref)
    found = json.loads(ts(cluster, "why", "--json", job.job_id))
    assert "node lost: node2 (ranks 2, 3 stopped answering at step" in found["recoveries"][0]["cause"], found


def test_a_lost_batch_host_s_driver_is_replaced_by_the_sentinel_in_the_allocation(cluster, tmp_root):
    """Issue 66: node1 -- the batch host, which runs the job's driver -- lost with everything of the job on it: the
    sentinel on node2 finds the heartbeat unchanged and node1 not answering Slurm, and takes the driver's place in
    the same allocation (no requeue): the next step runs on node2 and the spare node3 within 20 s of the fault,
    the run finishes bitwise equal to an unfaulted one, the sentinel's driver ends the job and ``status``, ``wait``
    and ``why`` read it as completed (Slurm says CANCELLED), with the batch host's loss among its recoveries."""
    ref = reference(tmp_root, "srun")
    out = tmp_root / "batch-host"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, spare=1))
    wait_until(lambda: reached(out) >= 22 and len(rank_pids(out, "node1")) == 2, 120, "step 22")
    conf = Path(cluster["SLURM_CONF"])
    try:
        killed = kill_batch_host(out, job.job_id, "node1", conf)
        assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    finally:
        restore_nodes(cluster)
    log = job.log_path.read_text()
    assert re.search(r"the batch host node1 was lost \(the job's driver silent for \d+ s, the host not answering "
                     r"Slurm\): the driver's place is taken on node2 in this allocation \(takeover 1 of 2\)", log), log
    resumed = first_step_after(job, killed) - killed
    print(f"batch host lost -> the sentinel's driver -> first resumed step {resumed:.1f} s")
    assert resumed <= 20, resumed
    assert job_field(cluster, job.job_id, "Restarts") in ("0", None)  # never requeued (None: Slurm forgot it)
    assert same_parameters(out / "final.pt", ref)
    assert "COMPLETED" in ts(cluster, "status", job.job_id)
    found = json.loads(ts(cluster, "why", "--json", job.job_id))
    assert found["kind"] == "completed", found
    assert any("batch host lost: node1" in r["cause"] for r in found["recoveries"]), found


@ci_leaves_out("the batch host alone (its takeover) and the sentinel's restart on a spare: tests/test_allocation.py")
def test_the_sentinel_s_node_and_then_the_batch_host_lost_the_run_goes_on_on_the_last_node(cluster, tmp_root):
    """Issue 66: node2 (the sentinel's node) lost first -- the spare node3 takes its ranks and the sentinel starts
    again there -- then node1, the batch host: the sentinel on node3 takes the driver's place and, with no spare
    left, continues on node3 alone (--min-nodes 1); the run ends at its planned step with no requeue."""
    out = tmp_root / "sentinel-then-batch-host"
    out.mkdir(mode=0o777)
    job = submit_spec(spec(out, spare=1, min_nodes=1))
    wait_until(lambda: reached(out) >= 15 and len(rank_pids(out, "node2")) == 2, 120, "step 15")
    conf = Path(cluster["SLURM_CONF"])
    try:
        kill_node(out, "node2", conf)
        first = reached(out)
        wait_until(lambda: reached(out) >= first + 8 and "trainstack-sentinel" in subprocess.run(
            ["squeue", "-h", "-s", "-j", job.job_id, "-w", "node3", "-o", "%j"], capture_output=True, text=True,
            env=cluster).stdout, 120, "the spare's step and the sentinel on node3")
        killed = kill_batch_host(out, job.job_id, "node1", conf)
        assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    finally:
        restore_nodes(cluster)
    log = job.log_path.read_text()
    assert "the sentinel's node node2 is lost: watching the batch host from another node" in log, log
    assert "the driver's place is taken on node3 in this allocation" in log, log
    assert re.search(r"no spare left \(.*node1 lost.*\): continuing on 1 of 2 nodes \(node3\)", log), log
    assert log.count("the driver's place is taken") == 1, log  # the first sentinel, on node2, stood down
    resumed = first_step_after(job, killed) - killed
    print(f"sentinel's node, then the batch host lost -> continued on node3 -> first resumed step {resumed:.1f} s")
    assert resumed <= 20, resumed
    assert reached(out) == 60 and job_field(cluster, job.job_id, "Restarts") == "0"
    assert "COMPLETED" in ts(cluster, "status", job.job_id)

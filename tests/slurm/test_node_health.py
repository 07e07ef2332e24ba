"""Node health and time on the real local Slurm (node1-3 share this host's two cores): a node made slow by real
CPU contention -- its slurmd (so its tasks) pinned to one core with busy processes on that core -- is named by the
pre-flight node check and left out (the spare takes its place); the same contention started mid-run names that
node's ranks as stragglers with their phase, while contention on both nodes alike names nobody; the goodput ledger
of a run with a crash and a requeue adds up to the job's wall time and each part matches the logs' timestamps."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, ci_leaves_out

from trainstack._common.goodput import ledger
from trainstack.render import LaunchSpec
from trainstack.submit import submit_spec, wait_for

sys.path.insert(0, str(ROOT / "bench"))
from _faults import kill_rank, rank_pids, reached, wait_until  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(420)]  # real contention
PACE = str(Path(__file__).with_name("_pace_train.py"))
RECOVERY = str(Path(__file__).with_name("_recovery_train.py"))


def spec(out: Path, program: str, spare: int = 0, requeue: bool = False, node_check: bool | None = None,
         env: dict | None = None) -> LaunchSpec:
    return LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, launcher="srun", time="10",
                      job_name="trainstack-test", log_dir=str(out / "logs"), requeue=requeue, spare_nodes=spare,
                      partition="spares", node_check=node_check, env={"PROBE_OUT": str(out), **(env or {})},
                      venv=str(Path(sys.executable).parents[1]), program=[program])


def slurmd_pid(cluster: dict, node: str) -> int:
    return int((Path(cluster["SLURM_CONF"]).parent / f"slurmd-{node}.pid").read_text().strip())


def pin(pid: int, core: str) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", core, str(pid)], check=True, capture_output=True)


@contextlib.contextmanager
def busy(core: str, count: int = 3):
    """``count`` busy processes pinned to ``core``, stopped by pid. Each in a session of its own: with the kernel's
    autogroup scheduling, processes of one session share one group's CPU share (the group of a node's slurmd would
    get half the core against all of them together, not one share in ``count + 1``)."""
    procs = [subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"],
                              start_new_session=True) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


@contextlib.contextmanager
def node2_slowed(cluster: dict):
    """node2's slurmd (so its tasks) pinned to core 1 with four busy processes there, node1 and node3 on core 0;
    every node gets both cores back on leaving."""
    for node, core in (("node1", "0"), ("node3", "0"), ("node2", "1")):
        pin(slurmd_pid(cluster, node), core)
    try:
        with busy("1", count=4):
            yield
    finally:
        for node in ("node1", "node2", "node3"):
            pin(slurmd_pid(cluster, node), "0-1")


@pytest.fixture
def cluster(slurm_env, monkeypatch):
    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    yield slurm_env
    for node in ("node1", "node2", "node3"):  # the nodes get both cores back
        with contextlib.suppress(OSError, subprocess.CalledProcessError, ValueError):
            pin(slurmd_pid(slurm_env, node), "0-1")
    subprocess.run(["pkill", "-9", "-f", PACE], check=False)


def job_events(job) -> list[dict]:
    path = job.log_path.with_suffix("") / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ts(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "trainstack", *args], capture_output=True, text=True,
                          timeout=60).stdout


def test_a_slow_node_is_left_out_before_training_and_a_spare_takes_its_place(cluster, tmp_path):
    """node2's slurmd pinned to core 1 with four busy processes there, node1 and node3 on core 0: the check names
    node2 with its figure, the step runs on node1,node3; status and why name it; the check stays in its budget."""
    tmp_path.chmod(0o777)
    with node2_slowed(cluster):
        job = submit_spec(spec(tmp_path, PACE, spare=1, requeue=True, env={"PACE_STEPS": "20"}))
        assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "node check named node2" in log or "node check: node2: compute" in log, log
    assert "leaving out node2; the step runs on node1,node3" in log, log
    checks = [json.loads(line) for line in (job.log_path.with_suffix("") / "node-checks.jsonl").read_text()
              .splitlines()]
    # one check of the step's nodes and the spare together, then node2 measured again beside a node that passed
    # (one noisy window is not evidence enough): the spare takes node2's place without a check of its own
    assert len(checks) == 2 and set(checks[0]["figures"]) == {"node1", "node2", "node3"}, checks
    assert set(checks[1]["figures"]) == {"node2", "node1"} and list(checks[1]["named"]) == ["node2"], checks[1]
    assert list(checks[0]["named"]) == ["node2"] and "x the median" in checks[0]["named"]["node2"], checks[0]
    assert (checks[0]["link"] or {}).get("ring_gbps"), checks[0]  # the ring met at the first node
    assert all(c["seconds"] <= 30 for c in checks), [c["seconds"] for c in checks]
    print(f"node check: {[c['seconds'] for c in checks]} s")
    why = ts("why", job.job_id)
    assert "node check named node2: compute" in why and "goodput" in why, why
    status = ts("status", "--attempts", job.job_id)
    assert "node check named node2" in status and "goodput" in status, status
    report = (job.log_path.with_suffix("") / "attempt-0.0.txt").read_text()
    assert "node check named node2" in report and "verdict: ended normally" in report, report


@ci_leaves_out("the node check's real-Slurm path is the spare's; its requeue decision is tests/test_allocation.py's")
def test_a_slow_node_without_a_spare_requeues_the_job_without_it(cluster, tmp_path):
    """No spare: node2, slow at the first check, is left out by requeueing the job (ExcNodeList), the requeued
    attempt runs on node1,node3 and finishes; the decision is a verdict row that status shows."""
    tmp_path.chmod(0o777)
    with node2_slowed(cluster):
        job = submit_spec(spec(tmp_path, PACE, spare=0, requeue=True, env={"PACE_STEPS": "20"}))
        wait_until(lambda: job.log_path.exists() and "requeueing job" in job.log_path.read_text(), 120,
                   "the requeue")
    assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    log = job.log_path.read_text()
    assert "node check named node2: no spare in this allocation; requeueing without it" in log, log
    assert "the requeued attempt leaves out node2" in log and "nodes: node[1,3] (2)" in log, log
    rows = [json.loads(line) for line in (job.log_path.with_suffix("") / "verdicts.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "node check" and rows[0]["excluded"] == ["node2"], rows
    assert "node check named node2" in ts("status", "--attempts", job.job_id)


def test_a_straggler_is_named_with_its_phase_uniform_slowness_is_not(cluster, tmp_path):
    """Mid-run, first a busy process on each core while every rank may run on both (uniform: nobody named for
    20 s), then node1's ranks pinned to core 0, node2's to core 1 with three busy processes there: node2's ranks
    are named, with the forward phase, within seconds; the lag is printed. (Ratio 2: a 2-core box that shares its
    cores unevenly among floating processes sees 1.6x between ranks it loads "alike"; the straggler here is ~4x.)"""
    tmp_path.chmod(0o777)
    job = submit_spec(spec(tmp_path, PACE, node_check=False, env={"TRAINSTACK_HANG_TIMEOUT": "30",
                                                                  "TRAINSTACK_STRAGGLER_RATIO": "2"}))
    try:
        wait_until(lambda: reached(tmp_path) >= 50 and len(rank_pids(tmp_path, "node2")) == 2
                   and len(rank_pids(tmp_path, "node1")) == 2, 180, "step 50")
        with busy("1", count=1), busy("0", count=1):
            time.sleep(20)  # four watchdog intervals: enough to be named if it were
        assert not [e for e in job_events(job) if e["kind"] == "straggler"], job_events(job)
        for pid in rank_pids(tmp_path, "node1"):
            pin(pid, "0")
        for pid in rank_pids(tmp_path, "node2"):
            pin(pid, "1")
        with busy("1"):
            slowed = time.time()
            wait_until(lambda: any(e["kind"] == "straggler" for e in job_events(job)), 90, "a straggler")
        named = [e for e in job_events(job) if e["kind"] == "straggler"]
        lag = named[0]["time"] - slowed
        print(f"straggler detection lag: {lag:.1f} s; {named}")
        assert {e["host"] for e in named} == {"node2"} and {e["rank"] for e in named} <= {2, 3}, named
        assert named[0]["phase"] == "forward" and named[0]["ratio"] >= 2, named
        status = ts("status", job.job_id)
        assert "straggler: rank" in status and "(node2)" in status and "forward" in status, status
        live = r"\| straggler rank [23] \(node2\) forward \d+\.\dx"  # the live lines carry it too
        wait_until(lambda: re.search(live, job.log_path.read_text()), 60, "a live line naming the straggler")
    finally:
        subprocess.run(["scancel", job.job_id], check=False)
        with contextlib.suppress(Exception):
            wait_for(job, timeout=60)
    log = job.log_path.read_text()
    assert "trainstack: straggler: rank" in log, log[-3000:]


@ci_leaves_out("the ledger's sums: tests/test_goodput*.py; a crash and a requeue on real Slurm: test_recovery.py")
def test_the_goodput_ledger_of_a_crash_and_a_requeue_adds_up_to_the_wall_time(cluster, tmp_path):
    """A rank killed (retried in the allocation), then a graceful stop (requeued): the ledger's parts add up to
    the job's wall time from Slurm's submit to the end (within 1 %, Slurm's timestamps being whole seconds), queue
    matches sacct, recovery the fault -> relaunch, node check its own records, rollback the steps lost."""
    tmp_path.chmod(0o777)
    job = submit_spec(spec(tmp_path, RECOVERY, requeue=True, env={"STEP_SLEEP": "0.15", "SLOW_ALWAYS": "1"}))
    wait_until(lambda: reached(tmp_path) >= 17, 120, "step 17")
    kill_rank(tmp_path, "node1", 1)
    wait_until(lambda: any(e["kind"] == "first_step" for e in job_events(job)), 120, "the resumed first step")
    time.sleep(2)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job.job_id], check=True)
    assert wait_for(job, timeout=300) == 0, job.log_path.read_text()
    folder = job.log_path.with_suffix("")
    found = ledger(folder)
    assert found is not None and found["ended"], found
    parts, total = found["parts"], found["total_s"]
    assert abs(sum(parts.values()) - total) <= 0.01 * total, (parts, total)
    rows = subprocess.run(["sacct", "-j", job.job_id, "-D", "-X", "-n", "-P", "-o", "Submit,Start,End"],
                          capture_output=True, text=True).stdout.split()
    print(f"ledger: {json.dumps(found['parts'])} total {total} s goodput {found['goodput']:.3f}; sacct {rows}")
    evs = job_events(job)
    starts = [e for e in evs if e["kind"] == "job_start"]
    assert len(starts) == 2, starts  # the first attempt and the requeued one
    wall = [e for e in evs if e["kind"] == "job_end"][-1]["time"] - starts[0]["submitted"]
    assert abs(total - wall) <= max(0.01 * wall, 1.0), (total, wall)
    queue = sum(s["time"] - s["submitted"] for s in starts)
    assert abs(parts["queue"] - queue) <= 2.0 + 0.01 * wall, (parts["queue"], queue)
    crash = next(json.loads(line) for line in (folder / "verdicts.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "killed (signal 9)")
    books = [json.loads(p.read_text()) for p in (folder / "ledger").glob("*.json")]
    retry = next(b for b in books if (b.get("restart"), b.get("step_index")) == (0, 1))
    # the fault -> the retry's training loop: detection, teardown, decision, relaunch and restore (what it cost)
    assert 0 < parts["recovery"] and abs(parts["recovery"] - (retry["loop_started"] - crash["fault_time"])) <= 2.0, \
        (parts, retry["loop_started"] - crash["fault_time"])
    checked = sum(json.loads(line)["seconds"] for line in (folder / "node-checks.jsonl").read_text().splitlines())
    assert abs(parts["node_check"] - checked) <= 0.1, (parts["node_check"], checked)
    assert parts["productive"] > 0 and parts["checkpoint"] > 0 and parts["startup"] > 0, parts
    callbacks = sum(b["spent"].get("callback", 0) + b["spent"].get("after", 0) for b in books)  # the test's sleeps
    assert callbacks - 0.5 <= parts["other"] <= callbacks + 0.15 * total, (parts, callbacks)
    status = ts("status", "--attempts", job.job_id)
    assert "goodput" in status and "step 0.1" in status, status
    why = json.loads(ts("why", "--json", job.job_id).splitlines()[0])
    assert why["goodput"]["parts"] == parts, why

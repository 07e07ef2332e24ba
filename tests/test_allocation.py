"""The allocation driver's loop without Slurm (the real-Slurm confirmation of each path is tests/slurm/): a fake
``Slurm`` runs each job step as a small process (tests/_fake_step.py) that fails the ranks a scenario names, hangs
like a lost node, or answers a stop request; its probes, node checks and requeue calls are recorded. Each case is a
decision of the one retry policy, read back from what the driver said, launched and recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainstack._common import jobevents as jobevents
from trainstack._common.jobfiles import JobFiles
from trainstack._slurm.allocation import Allocation, NodePool
from trainstack._slurm.plan import Launch, Plan, Recovery, build_plan
from trainstack._slurm.slurmcmd import Slurm
from trainstack._slurm.spec import LaunchSpec

pytestmark = pytest.mark.timeout(60)
FAKE_STEP = str(Path(__file__).with_name("_fake_step.py"))
FAKE_STANDBY = str(Path(__file__).with_name("_fake_standby.py"))


class FakeSlurm(Slurm):
    """Slurm as a job's driver sees it: ``hosts`` allocated, ``steps`` the scenarios of the job steps it launches,
    ``lost`` the hosts that do not answer a probe, node-check figures per host, the partition's nodes in service."""

    def __init__(self, hosts: list[str], steps: list[dict], lost: tuple[str, ...] = (), left: int | None = None,
                 rates: dict[str, float] | None = None, serving: dict[str, bool] | None = None,
                 answer_s: float = 0.0, live_s: float = 0.0) -> None:
        super().__init__("100", {})
        self.hosts, self.steps, self.lost, self.left = hosts, list(steps), set(lost), left
        self.answer_s = answer_s  # how long a probe of the hosts takes (a lost host's silence: seconds)
        self.live_s = live_s  # how long a live host takes to answer it
        self.rates = rates or {}
        self.serving = serving if serving is not None else dict.fromkeys(hosts, True)
        self.launched: list[list[str]] = []
        self.calls: list[tuple] = []
        self.scontrol: list[tuple[int, str]] = []
        self.standby: dict = {}  # how the standbys it starts behave (tests/_fake_standby.py)

    def hostnames(self, nodelist: str) -> list[str]:
        return list(self.hosts)

    def seconds_left(self) -> int | None:
        return self.left

    def submitted(self) -> float:
        return 0.0

    def partition_nodes(self) -> dict[str, bool]:
        return dict(self.serving)

    def log_path(self) -> Path | None:
        return None

    def launch(self, argv, env, cwd=None, output=None):  # noqa: ANN001 -- as Slurm.launch
        if "trainstack._slurm.takeover" in argv:
            self.calls.append(("sentinel", nodelist(argv)))
            return subprocess.Popen(["true"])
        if "trainstack._runtime.standby" in argv:
            name = argv[argv.index("trainstack._runtime.standby") + 1]
            self.calls.append(("standby", nodelist(argv), name, "--torchrun" in argv))
            return subprocess.Popen([sys.executable, FAKE_STANDBY, name, nodelist(argv)],
                                    env={**env, "FAKE_STANDBY": json.dumps(self.standby),
                                         "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                                    stdin=subprocess.DEVNULL)
        self.launched.append(list(argv))
        scenario = self.steps.pop(0) if self.steps else {}
        return subprocess.Popen([sys.executable, FAKE_STEP], env={**env, "FAKE_STEP": json.dumps(scenario)},
                                stdin=subprocess.DEVNULL)

    def on_nodes(self, hosts, argv, timeout, output=None, env=None):  # noqa: ANN001 -- as Slurm.on_nodes
        out = Path(argv[argv.index("--out") + 1])
        self.calls.append(("node_check", tuple(hosts)))
        assert env is not None and env["MASTER_ADDR"] == hosts[0], "the check's ring meets at the first node"
        for host in hosts:
            (out / f"{host}.json").write_text(json.dumps({"gflops": [self.rates.get(host, 100.0)],
                                                          "gpus_visible": 0, "gpus": []}))
        return 0

    def each(self, hosts, argv, timeout, settle_s=None, into=None):  # noqa: ANN001 -- as Slurm.each
        """Live hosts answer after ``live_s``, the lost ones' silence is known after ``answer_s``."""
        self.calls.append(("each", tuple(hosts), argv[0]))
        answers = into if into is not None else {}
        time.sleep(min(self.live_s, self.answer_s))
        answers.update({h: True for h in hosts if h not in self.lost})
        time.sleep(max(self.answer_s - self.live_s, 0))
        answers.update({h: h not in self.lost for h in hosts})
        return {h: answers[h] for h in hosts}

    def kill_steps(self, keep: str = "") -> None:
        self.calls.append(("kill_steps",))

    def _run(self, argv, timeout: float = 30, cwd=None) -> tuple[int, str]:  # noqa: ANN001 -- as Slurm._run
        """The requeue's scontrol calls, recorded as ("requeue", job), ("exclude", job, hosts), ("start_now", job);
        Slurm's answers from ``scontrol`` (a list of (code, text), first first), else success."""
        if argv[:2] == ["scontrol", "requeue"]:
            self.calls.append(("requeue", argv[2]))
        elif argv[:2] == ["scontrol", "update"] and argv[3].startswith("ExcNodeList="):
            self.calls.append(("exclude", argv[2].removeprefix("JobId="), tuple(argv[3].split("=")[1].split(","))))
        elif argv[:2] == ["scontrol", "update"] and argv[3] == "StartTime=now":
            self.calls.append(("start_now", argv[2].removeprefix("JobId=")))
        elif argv[:2] == ["scontrol", "update"] and argv[3].startswith("NodeList="):
            self.calls.append(("release", tuple(argv[3].split("=")[1].split(","))))
        elif argv[:2] == ["scontrol", "update"] and argv[3].startswith("NumNodes="):
            self.calls.append(("nodes", argv[2].removeprefix("JobId="), argv[3].split("=")[1]))
        elif argv[0] == "scancel":
            self.calls.append(("scancel", argv[1]))
        else:
            raise AssertionError(f"the driver ran an unexpected Slurm command: {argv}")
        return self.scontrol.pop(0) if self.scontrol else (0, "")


def plan(tmp_path: Path, nodes: int = 2, spare: int = 0, node_check: bool = False, launcher: str = "srun",
         **recovery: object) -> Plan:
    """A --requeue plan of ``nodes`` x 2 CPU processes, with quick teardown; the versions probe is ``true``."""
    spec = LaunchSpec(setup="multi-node", nodes=nodes, cpu=True, procs_per_node=2, requeue=True, spare_nodes=spare,
                      node_check=node_check, log_dir=str(tmp_path / "logs"), program=["train.py"], launcher=launcher)
    built = build_plan(spec)
    fields = {**built.recovery.__dict__, "teardown_grace_s": 0.2, **recovery}
    return Plan(**{**built.__dict__, "recovery": Recovery(**fields), "probe": ["true"]})


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Runs a driver on a plan and a fake Slurm; restores the signal handlers and the environment it changed."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.delenv("TRAINSTACK_JOB_DIR", raising=False)
    said: list[str] = []

    def run(p: Plan, slurm: FakeSlurm, **env: str) -> tuple[int, Allocation]:
        # restarts in place (the driver's default with srun) are on where a test asks for them: a scenario's ranks
        # that say nothing would otherwise be waited for (tests of in place pass TRAINSTACK_IN_PLACE="1"); so are
        # warm standbys (TRAINSTACK_STANDBY)
        base = {"SLURM_JOB_ID": "100", "SLURM_NNODES": str(p.allocated_nodes), "SLURM_JOB_NODELIST": "x",
                "PATH": os.environ["PATH"], "TRAINSTACK_IN_PLACE": "0", "TRAINSTACK_STANDBY": "0", **env}
        alloc = Allocation(p, slurm, base, poll_s=0.02, kill_after_s=0.2,
                           emit=lambda line, error: said.append(line))
        return alloc.run(), alloc

    run.said = said  # type: ignore[attr-defined]
    yield run
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def rows(alloc: Allocation) -> list[dict]:
    return JobFiles(alloc.files.folder).verdicts()


def nodelist(argv: list[str]) -> str:
    return next(w.split("=", 1)[1] for w in argv if w.startswith("--nodelist="))


def test_a_lost_node_is_replaced_by_a_spare_in_the_allocation(tmp_path, job):
    """Rank 2 on node2 fails and node2 stops answering; the step hangs (srun waits for the lost node) until the
    driver kills it; the verdict is a node failure, node2 is blamed, and step 1 runs on node1 and the spare."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [{"fail": [{"rank": 2, "host": "node2", "code": 1}], "hang": True},
                                                   {}], lost=("node2",))
    status, alloc = job(plan(tmp_path, spare=1), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1,node3"]
    assert ("kill_steps",) in slurm.calls and not any(c[0] == "requeue" for c in slurm.calls)
    assert ("sentinel", "node2") in slurm.calls  # the batch host (node1) is watched from another node
    assert ("sentinel", "node3") in slurm.calls  # ... and again from the spare once node2 is lost (issue 66)
    assert ("release", ("node1", "node3")) in slurm.calls  # the lost node handed back: the end does not wait for it
    assert "handed node2 back to Slurm (lost; the job goes on with node1,node3)" in job.said
    assert "the sentinel's node node2 is lost: watching the batch host from another node" in job.said
    (row,) = rows(alloc)
    assert row["kind"] == "node failure" and row["blamed"] == "node2" and row["retried"], row
    assert "crash (exit status 1): retrying in this allocation as step 1 on node1,node3 (no requeue)" in job.said
    assert "finished (restart count 0) after 1 retries in this allocation" in job.said
    assert JobFiles(alloc.files.folder).exit_code() == "0"
    kinds = [e["kind"] for e in map(json.loads, alloc.files.events_file.read_text().splitlines())]
    assert kinds == ["job_start", "step_start", "detected", "step_end", "step_start", "relaunch", "released",
                     "step_end", "job_end"]


def test_ranks_that_lost_their_peer_are_the_detection_of_a_node_lost_with_no_exit_to_record(tmp_path, job):
    """node2 gone with its ranks (no exit record: nothing of it is left to write one); the ranks on node1 say they
    lost a peer and sleep (fastexit): the driver detects it from that, its probe finds node2 gone, and the step is
    killed without waiting for any exit; step 1 runs on the spare."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [
        {"peer_lost": [{"rank": 0, "host": "node1"}, {"rank": 1, "host": "node1"}], "hang": True}, {}],
        lost=("node2",))
    status, alloc = job(plan(tmp_path, spare=1), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1,node3"]
    assert ("kill_steps",) in slurm.calls and not JobFiles(alloc.files.folder).step.exits()
    (row,) = rows(alloc)
    assert row["kind"] == "node failure" and row["blamed"] == "node2", row


def _events(alloc: Allocation) -> list[dict]:
    return [json.loads(line) for line in alloc.files.events_file.read_text().splitlines()]


@pytest.mark.parametrize("rung", ["spare", "shrink"])
def test_a_host_whose_ranks_fell_silent_is_left_out_before_the_probe_answers(tmp_path, job, rung):
    """node2 lost whole under srun: node1's ranks say they lost a peer, node2's say nothing and no task records an
    exit. PRESUME_LOST_S later node2 is presumed lost -- with a spare at once; without one (--min-nodes 1) once
    Slurm's probe has heard node1 (0.2 s) but not node2 for as long again -- and the step is ended and the next one
    launched (on the spare, or shrunk on node1) while the probe (3 s here: its settle window) still asks: the new
    step never waits for Slurm's answer on the dead node, which then confirms it."""
    spare = rung == "spare"
    slurm = FakeSlurm(["node1", "node2", "node3"] if spare else ["node1", "node2"], [
        {"peer_lost": [{"rank": 0, "host": "node1"}, {"rank": 1, "host": "node1"}], "hang": True}, {}],
        lost=("node2",), answer_s=3.0, live_s=0.0 if spare else 0.2)
    status, alloc = job(plan(tmp_path, spare=1) if spare else plan(tmp_path, min_nodes=1), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1,node3" if spare else "node1"]
    at = {e["kind"]: e for e in _events(alloc)}
    assert at["presumed_lost"]["nodes"] == "node2", at
    assert at["relaunch"]["time"] - at["detected"]["time"] < 2.0, at  # not the probe's 3 s
    assert alloc.pool.lost == ["node2"] and "answered" not in at
    (row,) = rows(alloc)
    assert row["kind"] == "node failure" and row["blamed"] == "node2", row
    if not spare:
        assert any("continuing on 1 of 2 nodes (node1)" in line for line in job.said), job.said


def test_a_host_presumed_lost_that_answers_after_all_is_a_spare_again(tmp_path, job):
    """The probe, answered beside the next step, finds node2 there after all (its ranks were killed, the node was
    not): node2 is usable again -- said, recorded -- and the run goes on on the spare meanwhile."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [
        {"peer_lost": [{"rank": 0, "host": "node1"}, {"rank": 1, "host": "node1"}], "hang": True},
        {"duration": 1.5}], answer_s=0.6)
    status, alloc = job(plan(tmp_path, spare=1), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1,node3"]
    assert "node2 answered Slurm after all (presumed lost when its ranks fell silent): usable again, as a spare" \
        in job.said
    assert alloc.pool.lost == [] and "answered" in [e["kind"] for e in _events(alloc)]


@pytest.mark.parametrize("why", ["no spare", "slurm silent everywhere", "an exit recorded", "torchrun"])
def test_a_silent_host_is_not_presumed_lost_where_a_mistake_would_cost_more_or_exits_come_late(tmp_path, job, why):
    """No spare and no --min-nodes (a requeue waits for the probe's answer), a shrink where Slurm has not answered
    for any host yet (no evidence beyond the ranks' silence), a task's exit record (a crash: the hosts are there),
    torchrun (its agent records a worker's exit ~1 s late): the probe decides."""
    two = why in ("no spare", "slurm silent everywhere")
    hosts = ["node1", "node2"] if two else ["node1", "node2", "node3"]
    fail = [{"rank": 3, "host": "node2", "code": 1}] if why == "an exit recorded" else []
    slurm = FakeSlurm(hosts, [{"peer_lost": [{"rank": 0, "host": "node1"}, {"rank": 1, "host": "node1"}],
                               "fail": fail, "hang": True}, {}], lost=("node2",), answer_s=1.0,
                      live_s=1.0 if why == "slurm silent everywhere" else 0.0)
    p = plan(tmp_path, spare=0 if two else 1, max_retries=1,
             **({"min_nodes": 1} if why == "slurm silent everywhere" else {}))
    if why == "torchrun":
        p = Plan(**{**p.__dict__, "launch": Launch(**{**p.launch.__dict__, "task_log": "none", "torchrun": True})})
    _, alloc = job(p, slurm)
    kinds = [e["kind"] for e in _events(alloc)]
    assert "detected" in kinds and "presumed_lost" not in kinds, kinds


def test_a_step_whose_every_rank_is_out_is_killed_without_waiting_out_the_grace(tmp_path, job):
    """Rank 1 killed (its exit recorded), ranks 0, 2, 3 lost their peer and sleep: every rank is accounted for, so
    the step is killed at once, not after the 3 s grace (which stays for ranks that may still end by themselves)."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 1, "host": "node1", "code": 137}],
                                            "peer_lost": [{"rank": r, "host": f"node{1 + r // 2}", "delay": 0.1}
                                                          for r in (0, 2, 3)], "hang": True}])
    _, alloc = job(plan(tmp_path, max_retries=0, teardown_grace_s=3.0), slurm)
    at = {e["kind"]: e["time"] for e in _events(alloc)}
    (first,) = JobFiles(alloc.files.folder).step.exits()
    assert at["step_end"] - first.time < 1.5, (at, first)
    (row,) = rows(alloc)
    assert row["status"] == 137 and row["rank"] == 1, row


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_step_of_node_tasks_whose_every_rank_is_out_is_killed_without_waiting_out_the_grace(tmp_path, job,
                                                                                            launcher):
    """One task per node (torchrun's agent, trainstack's spawn): node1's task failed (its exit recorded) and both
    ranks of node2 lost their peer: every node is out, so the step is killed at once. With one of node2's ranks
    still silent (it may end by itself, or be the cause), the grace is waited out."""
    def scenario(silent: bool) -> dict:
        return {"fail": [{"unit": "node-0", "host": "node1", "code": 1}],
                "peer_lost": [{"rank": r, "host": "node2", "delay": 0.1} for r in ((2,) if silent else (2, 3))],
                "hang": True}

    for silent, grace in ((False, 3.0), (True, 1.0)):
        _, alloc = job(plan(tmp_path / str(silent), max_retries=0, teardown_grace_s=grace, launcher=launcher),
                       FakeSlurm(["node1", "node2"], [scenario(silent)]))
        at = {e["kind"]: e["time"] for e in _events(alloc)}
        (first,) = JobFiles(alloc.files.folder).step.exits()
        waited = at["step_end"] - first.time
        assert (waited >= grace) if silent else (waited < 1.5), (silent, at, first)
        (row,) = rows(alloc)
        assert row["status"] == 1, row


def test_a_lost_peer_is_not_the_cause_the_rank_that_failed_first_is(tmp_path, job):
    """Ranks 0-2 lose their peer while rank 3 is still leaving through Python's slower exit (status 2): detected at
    once, but the step is not killed before rank 3's exit is recorded -- its status is the step's."""
    slurm = FakeSlurm(["node1", "node2"], [{"peer_lost": [{"rank": r, "host": f"node{1 + r // 2}"} for r in range(3)],
                                            "fail": [{"rank": 3, "host": "node2", "code": 2, "delay": 0.8}],
                                            "hang": True}])
    status, alloc = job(plan(tmp_path, max_retries=0), slurm)
    kinds = {e["kind"]: e["time"] for e in map(json.loads, alloc.files.events_file.read_text().splitlines())}
    (first,) = JobFiles(alloc.files.folder).step.exits()
    assert kinds["detected"] < first.time < kinds["step_end"], kinds  # detected before the cause left, not killed
    (row,) = rows(alloc)
    assert row["status"] == 2 and row["rank"] == 3, row


def test_a_lost_node_without_a_spare_requeues_the_job_leaving_it_out(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 3, "host": "node2", "code": 1}], "hang": True}],
                      lost=("node2",), serving={"node1": True, "node2": True, "node3": True})
    status, alloc = job(plan(tmp_path), slurm)
    assert status == 0, job.said
    assert [c for c in slurm.calls if c[0] in ("requeue", "exclude", "start_now")] == [
        ("requeue", "100"), ("exclude", "100", ("node2",)), ("start_now", "100")]
    assert "crash (exit status 1): requeueing job 100 as restart 1" in job.said
    assert "the requeued attempt leaves out node2 (blamed by a verdict)" in job.said
    assert not any(c[0] == "each" and c[2] == "bash" for c in slurm.calls)  # memory kept for the requeued attempt


BUSY = (1, "slurm_update error: Job update not available right now, the DB index is being set, try again in a bit")


def test_a_requeue_asks_again_while_slurm_answers_not_now_and_says_a_hold_it_could_not_release(tmp_path, job,
                                                                                                 monkeypatch):
    """Slurm answers "not now" to the update of a job whose failed node it is taking out: asked again until it
    takes it; a hold Slurm keeps (the release refused for good) is said with what it means."""
    monkeypatch.setattr("trainstack._slurm.slurmcmd.RETRY_PAUSE_S", 0.01)
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 3, "host": "node2", "code": 1}], "hang": True}],
                      lost=("node2",), serving={"node1": True, "node2": True, "node3": True})
    slurm.scontrol = [BUSY, (0, ""), BUSY, BUSY, (0, ""), (1, "Access/permission denied")]
    status, _ = job(plan(tmp_path), slurm)
    assert status == 0, job.said
    assert [c[0] for c in slurm.calls if c[0] in ("requeue", "exclude", "start_now")] == [
        "requeue", "requeue", "exclude", "exclude", "exclude", "start_now"]
    assert "the requeued attempt leaves out node2 (blamed by a verdict)" in job.said
    assert "Slurm keeps its hold on the requeued job (Access/permission denied): it starts after Slurm's own " \
           "delay, about two minutes" in job.said, job.said


def test_a_requeue_slurm_refuses_is_the_failure_it_was_not_success(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 3, "host": "node2", "code": 1}], "hang": True}],
                      lost=("node2",), serving={"node1": True, "node2": True, "node3": True})
    slurm.scontrol = [(1, "Requested operation is presently disabled")]
    status, _ = job(plan(tmp_path), slurm)
    assert status == 1 and [c[0] for c in slurm.calls if c[0] in ("requeue", "exclude", "start_now")] == ["requeue"]
    assert "scontrol requeue 100 failed: Requested operation is presently disabled" in job.said, job.said


def test_a_requeue_leaves_out_only_as_many_hosts_as_the_partition_can_spare(tmp_path, job):
    """A 2-node job on a 2-node partition cannot leave its blamed node out: requeued without ExcNodeList, said."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 3, "host": "node2", "code": 1}], "hang": True}],
                      lost=("node2",), serving={"node1": True, "node2": True})
    status, _ = job(plan(tmp_path), slurm)
    assert status == 0 and not any(c[0] == "exclude" for c in slurm.calls)
    assert any("could not leave out node2 (no other node in the partition for 2 node(s))" in line
               for line in job.said), job.said


def test_a_node_check_that_names_a_node_puts_the_spare_in_its_place(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}], rates={"node2": 10.0})
    status, alloc = job(plan(tmp_path, spare=1, node_check=True), slurm)
    assert status == 0, job.said
    # one check: the spare measured with the step's nodes, so it steps in without a second one; the named node
    # measured again beside one that passed before it is left out (one noisy window is not evidence enough)
    assert [c for c in slurm.calls if c[0] == "node_check"] == [("node_check", ("node1", "node2", "node3")),
                                                                 ("node_check", ("node2", "node1"))]
    assert [nodelist(a) for a in slurm.launched] == ["node1,node3"]
    assert "node check: leaving out node2; the step runs on node1,node3" in job.said
    first, again = JobFiles(alloc.files.folder).node_checks()
    assert list(first["named"]) == ["node2"] and "0.10x the median" in first["named"]["node2"]
    assert list(first["figures"]) == ["node1", "node2", "node3"] and list(again["named"]) == ["node2"]


def test_a_node_named_once_but_not_again_is_kept_and_a_removed_spare_is_said(tmp_path, job):
    """Issue 66: a noisy node check removed the only spare silently; now a named node is measured again, and a
    spare left out is said with what it leaves."""
    class Noisy(FakeSlurm):
        def on_nodes(self, hosts, argv, timeout, output=None, env=None):  # noqa: ANN001 -- as FakeSlurm.on_nodes
            self.rates = {"node3": 10.0} if not any(c[0] == "node_check" for c in self.calls) else {}
            return super().on_nodes(hosts, argv, timeout, output, env)

    status, _ = job(plan(tmp_path, spare=1, node_check=True), Noisy(["node1", "node2", "node3"], [{}]))
    assert status == 0 and "node check: node3 passed when measured again: kept (one noisy measurement)" in job.said
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}], rates={"node3": 10.0})
    status, _ = job(plan(tmp_path / "b", spare=1, node_check=True), slurm)
    assert any("node check: leaving out spare node3: 0 spare(s) left for a lost node -- a node lost now is recovered "
               "by a shrink or a requeue" in line for line in job.said), job.said


def test_a_spare_checked_at_the_start_replaces_a_lost_node_without_another_check(tmp_path, job):
    """The check's seconds stay out of a lost node's recovery: node3 was measured with node1 and node2 before the
    first step, so the retry on node1,node3 launches at once."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [{"fail": [{"rank": 2, "host": "node2", "code": 1}], "hang": True},
                                                   {}], lost=("node2",))
    status, alloc = job(plan(tmp_path, spare=1, node_check=True), slurm)
    assert status == 0, job.said
    assert [c for c in slurm.calls if c[0] == "node_check"] == [("node_check", ("node1", "node2", "node3"))]
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1,node3"]


def test_a_spare_named_by_the_check_is_left_out_and_the_step_runs_where_planned(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}], rates={"node3": 10.0})
    status, alloc = job(plan(tmp_path, spare=1, node_check=True), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2"] and alloc.pool.left_out == ["node3"]
    assert any(line.startswith("node check: node3: compute") for line in job.said), job.said


def test_a_node_check_without_a_spare_requeues_without_the_node(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2"], [], rates={"node2": 10.0},
                      serving={"node1": True, "node2": True, "node3": True})
    status, alloc = job(plan(tmp_path, node_check=True), slurm)
    assert status == 0 and slurm.launched == []
    assert ("exclude", "100", ("node2",)) in slurm.calls
    assert "node check named node2: no spare in this allocation; requeueing without it" in job.said
    assert rows(alloc)[-1]["category"] == "nodecheck"


def test_the_retry_budget_ends_the_retries(tmp_path, job):
    """--max-retries 1: the first crash is retried (progress: a later step), the second is not -- the budget is
    spent -- and the job ends with the crash's status."""
    crash = {"fail": [{"rank": 1, "host": "node1", "code": 137}]}
    slurm = FakeSlurm(["node1", "node2"], [{**crash, "log_step": 10}, {**crash, "log_step": 20}])
    status, alloc = job(plan(tmp_path, max_retries=1), slurm)
    assert status == 137 and len(slurm.launched) == 2
    assert [r["retried"] for r in rows(alloc)] == [True, False]
    assert "giving up after 1 earlier retries (--max-retries 1)" in rows(alloc)[-1]["decision"]
    assert not any(c[0] == "requeue" for c in slurm.calls)


def test_the_same_cause_without_progress_is_not_retried(tmp_path, job):
    crash = {"fail": [{"rank": 1, "host": "node1", "code": 137}], "log_step": 10}
    slurm = FakeSlurm(["node1", "node2"], [crash, crash])
    status, alloc = job(plan(tmp_path), slurm)
    assert status == 137 and len(slurm.launched) == 2
    assert "same as attempt 0, no progress (last step 10)" in rows(alloc)[-1]["decision"]


def test_too_little_time_left_requeues_instead_of_retrying_here(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2", "node3"], [{"fail": [{"rank": 0, "host": "node1", "code": 137}]}], left=30)
    status, _ = job(plan(tmp_path, spare=1), slurm)
    assert status == 0 and len(slurm.launched) == 1 and ("requeue", "100") in slurm.calls


@pytest.mark.parametrize("sig, kind, said", [
    (signal.SIGUSR2, "time limit", "SIGUSR2 at "),  # the time limit's warning
    (signal.SIGTERM, "preempted", "trainstack cancel ends a job without a requeue"),  # a preemption, or scancel
])
def test_a_stop_signal_during_a_step_checkpoints_and_requeues(tmp_path, job, sig, kind, said):
    """A stop signal reaches the driver while a step runs: it asks the trainer through the stop file, the trainer
    saves, and the job is requeued as a graceful stop, not a crash. Slurm sends SIGTERM for a preemption and for a
    plain scancel alike: the log line says that ``trainstack cancel`` is the way to end such a job."""
    timer = threading.Timer(0.4, os.kill, (os.getpid(), sig))
    timer.start()
    slurm = FakeSlurm(["node1", "node2"], [{"save_on_stop": True, "duration": 20}])
    try:
        status, alloc = job(plan(tmp_path), slurm)
    finally:
        timer.cancel()
    assert status == 0 and ("requeue", "100") in slurm.calls
    assert any(said in line and "asking the trainer to checkpoint and stop" in line for line in job.said), job.said
    assert rows(alloc)[-1]["kind"] == kind and rows(alloc)[-1]["category"] == ("timeout" if kind == "time limit"
                                                                              else "preempt")
    assert not alloc.files.stop.file.exists()


def test_a_cancelled_job_is_never_requeued(tmp_path, job):
    p = plan(tmp_path)
    folder = Path(p.job_dir_prefix + "100")
    folder.mkdir(parents=True)
    JobFiles(folder).cancel()
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 0, "host": "node1", "code": 137}]}])
    status, _ = job(p, slurm)
    assert status == 137 and "cancelled (trainstack cancel): not requeueing" in job.said
    assert not any(c[0] == "requeue" for c in slurm.calls)


def test_the_first_failing_task_is_the_steps_status_not_sruns(tmp_path, job):
    """srun ends with the 143 --kill-on-bad-exit sent the others; the exit record says rank 1 failed first with 7."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 1, "host": "node1", "code": 7}], "status": 143}])
    status, _ = job(plan(tmp_path, max_retries=0), slurm)
    assert status == 7
    assert any("rank 1 on node1 failed first (exit status 7 at" in line and "srun's 143 is the stop of the others"
               in line for line in job.said), job.said


def test_a_task_of_the_step_before_that_dies_late_is_not_the_new_steps_failure(tmp_path, job):
    """Rank 1 killed; step 1 starts at once while step 0's remains still die: rank 3 of step 0 records its end
    during step 1. The record names step 0, so step 1 is not torn down for it and finishes."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 1, "host": "node1", "code": 137}]},
                                          {"fail": [{"rank": 3, "host": "node2", "code": 1, "step": 0}],
                                           "status": 0, "duration": 0.5}])
    status, alloc = job(plan(tmp_path), slurm)
    assert status == 0, job.said
    assert len(slurm.launched) == 2 and not any("killing its tasks" in line for line in job.said[1:]), job.said
    assert [x.step for x in alloc.files.step.exits()] == [0] and alloc.files.step.exits(1) == []


def test_a_lost_node_without_a_spare_continues_on_the_survivors_above_min_nodes(tmp_path, job):
    """Shrink: node3 of 3 lost, no spare, --min-nodes 2 -> step 1 runs on node1,node2 at once (no requeue), every
    count in its launch follows (srun --nodes, --ntasks) and the trainer is told the planned world."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [{"fail": [{"rank": 5, "host": "node3", "code": 1}], "hang": True},
                                                   {}], lost=("node3",))
    status, alloc = job(plan(tmp_path, nodes=3, min_nodes=2), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2,node3", "node1,node2"]
    assert "--nodes=2" in slurm.launched[1] and "--ntasks=4" in slurm.launched[1], slurm.launched[1]
    assert not any(c[0] == "requeue" for c in slurm.calls)
    assert "no spare left (node3 lost): continuing on 2 of 3 nodes (node1,node2) from the newest complete state, at " \
           "its exact sample, without a requeue" in job.said, job.said
    shrunk = alloc.command.env(["node1", "node2"], alloc.step)
    assert shrunk["TRAINSTACK_NPROCS"] == "4"  # the job script's 6 would spawn 6 processes on the 2 nodes
    assert shrunk["TRAINSTACK_PLANNED_WORLD"] == "6" and "TRAINSTACK_PLANNED_WORLD" not in alloc.command.env(
        ["node1", "node2", "node3"], alloc.step)
    events = jobevents.read(alloc.files.folder, kind="shrink")
    assert events and events[0]["planned"] == 3 and events[0]["nodes"] == "node1,node2", events


def test_below_min_nodes_the_job_is_requeued_and_says_why(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 3, "host": "node2", "code": 1}], "hang": True}],
                      lost=("node2",), serving={"node1": True, "node2": True, "node3": True})
    status, _ = job(plan(tmp_path, min_nodes=2), slurm)
    assert status == 0 and ("requeue", "100") in slurm.calls and len(slurm.launched) == 1
    assert not any("continuing on" in line for line in job.said), job.said
    status, _ = job(plan(tmp_path / "three", nodes=3, min_nodes=3), FakeSlurm(
        ["node1", "node2", "node3"], [{"fail": [{"rank": 5, "host": "node3", "code": 1}], "hang": True}],
        lost=("node3",)))
    assert "only 2 usable node(s) left (node3 lost), fewer than --min-nodes 3: the job is requeued" in job.said, \
        job.said


def test_a_requeue_short_of_a_spare_may_start_with_the_nodes_it_gets(tmp_path, job):
    """Issue 66: --min-nodes 2 of 3, two nodes lost and no spare: the requeue leaves the blamed one out although
    the partition has no other node (the requeued job asks Slurm for 2-3 nodes, not 3: it does not wait for a lost
    node to come back), and the attempt that starts on 2 nodes runs shrunk on them, saying so."""
    slurm = FakeSlurm(["node1", "node2", "node3"], [{"fail": [{"rank": 3, "host": "node2", "code": 1},
                                                              {"rank": 5, "host": "node3", "code": 1}], "hang": True}],
                      lost=("node2", "node3"), serving={"node1": True, "node2": True, "node3": True})
    status, _ = job(plan(tmp_path, nodes=3, min_nodes=2), slurm)
    assert status == 0 and ("nodes", "100", "2-3") in slurm.calls, slurm.calls
    excluded = next(c for c in slurm.calls if c[0] == "exclude")
    assert excluded[2] == ("node2",), slurm.calls  # out: 2 of the partition's 3 are enough
    again = FakeSlurm(["node1", "node4"], [{}])
    status, alloc = job(plan(tmp_path / "requeued", nodes=3, min_nodes=2), again, SLURM_NNODES="2",
                        SLURM_RESTART_COUNT="1")
    assert status == 0 and [nodelist(a) for a in again.launched] == ["node1,node4"], job.said
    assert "the job started with 2 of its 3 node(s) (a requeue short of a spare; --min-nodes 2)" in job.said
    assert any("continuing on 2 of 3 nodes (node1,node4)" in line for line in job.said), job.said
    status, _ = job(plan(tmp_path / "no-min", nodes=3), FakeSlurm(["node1", "node4"], [{}]), SLURM_NNODES="2")
    assert status == 1 and "this script was generated for 3 node(s) but the job has 2" in job.said


def test_a_node_check_without_a_spare_shrinks_instead_of_requeueing_above_min_nodes(tmp_path, job):
    slurm = FakeSlurm(["node1", "node2"], [{}], rates={"node2": 10.0})
    status, alloc = job(plan(tmp_path, node_check=True, min_nodes=1), slurm)
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1"] and "--nodes=1" in slurm.launched[0]
    assert [c for c in slurm.calls if c[0] == "node_check"] == [("node_check", ("node1", "node2")),
                                                                 ("node_check", ("node2", "node1"))]  # confirmed
    assert not any(c[0] == "requeue" for c in slurm.calls)
    assert any("node2 named by the node check): continuing on 1 of 2 nodes (node1)" in line for line in job.said)


def test_a_launch_on_fewer_nodes_rewrites_every_count_and_nothing_else():
    spec = dict(setup="multi-node", nodes=4, cpu=True, procs_per_node=2, requeue=True, min_nodes=2,
                program=["train.py", "--nodes=4"])
    torchrun = build_plan(LaunchSpec(**spec, launcher="torchrun")).launch.on(3, 2)
    assert "--nnodes=3" in torchrun.command and "--nodes=3" in torchrun.srun and torchrun.program[-1] == "--nodes=4"
    accelerate = "accelerate launch --num_processes {num_processes} --num_machines {num_machines} t.py"
    custom = build_plan(LaunchSpec(**{**spec, "program": []}, launcher="custom", command=accelerate)).launch.on(3, 2)
    assert custom.env["TS_NUM_MACHINES"] == "3" and custom.env["TS_NUM_PROCESSES"] == "6"
    with pytest.raises(ValueError, match="--min-nodes.*5 is not between 1 and --nodes 4"):
        LaunchSpec(**{**spec, "min_nodes": 5})
    assert any("at least 2 of 4" in line for line in build_plan(LaunchSpec(**spec)).explain())


def test_the_launch_and_the_plan_it_comes_from(tmp_path):
    """Each step: srun on exactly its nodes, overlapping a failed step's remains; every task through the exit-record
    wrapper; a rendezvous port of its own per step; the plan survives its JSON and refuses another format."""
    p = plan(tmp_path, spare=1)
    assert Plan.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="format is 2, this driver .* reads format 1"):
        Plan.from_json(p.to_json().replace('"format": 1', '"format": 2'))
    alloc = Allocation(p, FakeSlurm(["a", "b", "c"], []), {"SLURM_JOB_ID": "100", "TRAINSTACK_IN_PLACE": "0"})
    argv = alloc.command.argv(["a", "c"])
    assert argv[:8] == ["srun", "--kill-on-bad-exit=1", "--wait=60", "--nodes=2", "--ntasks-per-node=2", "--ntasks=4",
                        "--nodelist=a,c", "--overlap"]
    assert argv[8:10] == ["bash", "-c"] and argv[11:] == ["trainstack-task", "rank", "python3", "-u", "train.py"]
    # restarts in place (the default with srun): a failed task leaves the others running, the driver ends the step
    alloc = Allocation(p, FakeSlurm(["a", "b", "c"], []), {"SLURM_JOB_ID": "100"})
    assert alloc.command.argv(["a", "c"])[:9] == ["srun", "--kill-on-bad-exit=0", "--nodes=2", "--ntasks-per-node=2",
                                          "--wait=0", "--no-kill", "--ntasks=4", "--nodelist=a,c", "--overlap"]
    assert alloc.command.argv(["a", "c"], ("c", [2, 3]))[:9] == [
        "srun", "--kill-on-bad-exit=0", "--nodes=1", "--ntasks-per-node=2", "--wait=0", "--no-kill", "--ntasks=2",
        "--nodelist=c", "--overlap"]
    assert alloc.command.env(["a", "c"], alloc.step, ("c", [2, 3]))["TRAINSTACK_TASK_RANKS"] == "2/2,3"
    first = alloc.command.env(["a", "c"], alloc.step)
    alloc.step = 1
    second = alloc.command.env(["c", "b"], alloc.step)
    assert first["MASTER_ADDR"] == "a" and second["MASTER_ADDR"] == "c" and first["MASTER_PORT"] != \
        second["MASTER_PORT"] and second["PET_RDZV_ID"] == "100.1"


def test_a_crashed_rank_restarts_alone_beside_the_ranks_waiting_in_place(tmp_path, job):
    """srun, rank 1 on node1 killed; ranks 0, 2, 3 say they wait in place. The step is not killed: the retry on the
    same nodes offers the waiting ranks step 1 (its rendezvous) and launches rank 1 alone on node1; the held step
    ends when its ranks finish in the new one. The recovery is recorded as any retry in the allocation."""
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.1} for r, h in ((0, "node1"), (2, "node2"),
                                                                                   (3, "node2"))]
    slurm = FakeSlurm(["node1", "node2"], [
        {"fail": [{"rank": 1, "host": "node1", "code": 137}], "peer_lost": waiting, "continue_in_place": 0.3},
        {"duration": 0.2}])
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE="1")
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1"]
    assert "--ntasks=1" in slurm.launched[1] and ("kill_steps",) not in slurm.calls, slurm.calls
    offer = alloc.files.step.offer_after(0)
    assert offer is not None and offer.step == 1 and offer.ranks == (0, 2, 3), offer
    assert set(offer.env) == {"MASTER_ADDR", "MASTER_PORT", "TRAINSTACK_ATTEMPT", "TRAINSTACK_STEP",
                              "TRAINSTACK_NPROCS"} and offer.per_node == 2, offer
    assert offer.env["TRAINSTACK_STEP"] == "1" and offer.env["MASTER_ADDR"] == "node1", offer
    assert "rank(s) 0, 2, 3 continue in place; starting rank(s) 1 on node1" in job.said, job.said
    (row,) = rows(alloc)
    assert row["kind"] == "killed (signal 9)" and row["retried"], row


def test_a_survivors_mark_written_between_the_watchs_reads_holds_the_step(tmp_path, monkeypatch):
    """CI (dfae04b): rank 3 said it waits in place just after the watch read the waiting marks and just before it
    read who is out -- counted out and not waiting, its step was torn down and relaunched whole. The records are read
    first now, so a mark written between the reads is seen by the second: the step is held."""
    from trainstack._slurm import watch as watching
    from trainstack._slurm.inplace import Survivors

    files, slurm = JobFiles(tmp_path / "job"), FakeSlurm(["node1", "node2"], [])
    (files.folder / "exits").mkdir(parents=True)
    (files.folder / "exits" / "rank-1").write_text(f"{time.time()} 137 rank-1 node1 0\n")
    for rank, host in ((0, "node1"), (2, "node2")):
        files.step.peer_lost(rank, host, 0, waiting=True)
    read = watching.all_out

    def racing(*args: object) -> bool:  # rank 3's mark lands between the watch's two reads
        files.step.peer_lost(3, "node2", 0, waiting=True)
        return read(*args)

    monkeypatch.setattr(watching, "all_out", racing)
    srun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = watching.StepWatch(files, plan(tmp_path), slurm, Survivors(files, slurm, set, True), 0,
                                   ["node1", "node2"], srun, [srun], 0.3, lambda: None, lambda hosts, ok: False)
        state = watch.poll(time.monotonic())
    finally:
        srun.kill()
        srun.wait()
    assert isinstance(state, watching.Held) and state.code == 137, state


def test_a_survivor_that_never_joins_its_offered_step_fails_the_step(tmp_path, job, monkeypatch):
    """Probe A25: a survivor that took the offer but cannot join (a rendezvous nobody serves) -- the driver does not
    count the step as started: it is killed, said, and relaunched whole (the survivors are not held again)."""
    import trainstack._slurm.inplace as driver_side

    monkeypatch.setattr(driver_side, "JOIN_S", 0.5)
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.1} for r, h in ((0, "node1"), (2, "node2"),
                                                                                   (3, "node2"))]
    slurm = FakeSlurm(["node1", "node2"], [
        {"fail": [{"rank": 1, "host": "node1", "code": 137}], "peer_lost": waiting, "continue_in_place": 0.3,
         "joins": False}, {"hang": True}, {"duration": 0.2}])
    status, _ = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE="1")
    assert status == 0, job.said
    assert any("rank(s) 0, 2, 3 did not join job step 1 within 0.5 s of its offer: killing its tasks" in line
               for line in job.said), job.said
    assert len(slurm.launched) == 3 and "--ntasks=4" in slurm.launched[2], slurm.launched


@pytest.mark.parametrize("value, on", [("false", False), ("off", False), ("0", False), ("yes", True),
                                       ("maybe", False)])
def test_in_place_restarts_take_the_usual_on_and_off_words(tmp_path, job, value, on):
    """Probe A27: TRAINSTACK_IN_PLACE=false turned them on (anything but 0 did); an unknown word is said, and off."""
    slurm = FakeSlurm(["node1", "node2"], [{"duration": 0.1}])
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE=value)
    assert status == 0 and alloc.in_place.enabled is on
    assert ("neither on" in " ".join(job.said)) is (value == "maybe"), job.said


@pytest.mark.parametrize("case", ["spare", "shrink"])
def test_a_lost_nodes_survivors_continue_in_place_on_a_spare_or_alone(tmp_path, job, case):
    """node2 lost whole (its ranks say nothing, the probe finds it gone); ranks 0, 1 on node1 wait in place. With a
    spare, step 1 starts only ranks 2, 3, on node3; without one (--min-nodes 1) no step starts at all: the waiting
    ranks continue as ranks 0, 1 of a world of 2, told the planned world of 4."""
    waiting = [{"rank": r, "host": "node1", "waiting": True, "delay": 0.1} for r in (0, 1)]
    hosts = ["node1", "node2", "node3"] if case == "spare" else ["node1", "node2"]
    slurm = FakeSlurm(hosts, [{"peer_lost": waiting, "continue_in_place": 0.3}, {"duration": 0.2}], lost=("node2",))
    status, alloc = job(plan(tmp_path, spare=1) if case == "spare" else plan(tmp_path, min_nodes=1), slurm,
                        TRAINSTACK_IN_PLACE="1")
    assert status == 0, job.said
    offer = alloc.files.step.offer_after(0)
    assert offer is not None and offer.ranks == (0, 1) and ("kill_steps",) not in slurm.calls, (offer, slurm.calls)
    if case == "spare":
        assert [nodelist(a) for a in slurm.launched] == [",".join(hosts[:2]), "node3"], slurm.launched
        assert "--ntasks=2" in slurm.launched[1] and offer.env["TRAINSTACK_NPROCS"] == "4", offer
        assert "rank(s) 0, 1 continue in place; starting rank(s) 2, 3 on node3" in job.said, job.said
    else:
        assert len(slurm.launched) == 1 and "rank(s) 0, 1 continue in place" in job.said, job.said
        assert offer.env["TRAINSTACK_NPROCS"] == "2" and offer.env["TRAINSTACK_PLANNED_WORLD"] == "4", offer
    (row,) = rows(alloc)
    assert row["kind"] == "node failure" and row["blamed"] == "node2", row


@pytest.mark.parametrize("case", ["requeue", "other nodes", "off"])
def test_ranks_waiting_in_place_are_killed_where_the_next_step_cannot_continue_them(tmp_path, job, case):
    """No retry (a Python error is not retried: the job ends), a retry on other nodes (node2 blamed, the spare
    takes its place: the waiting ranks' places move), or restarts in place turned off: the held step is killed and
    every rank of the next step, if any, starts afresh."""
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.1} for r, h in ((0, "node1"), (1, "node1"),
                                                                                   (3, "node2"))]
    code = 1 if case == "requeue" else 137
    first = {"fail": [{"rank": 2, "host": "node2", "code": code}], "peer_lost": waiting, "hang": True}
    # node2's probe answers after rank 3 said it waits (1 s, however loaded the box): node2 is blamed with a live
    # waiting rank on it -- not a lost node whose survivors would continue in place beside the spare
    slurm = FakeSlurm(["node1", "node2", "node3"], [first, {}], lost=("node2",) if case == "other nodes" else (),
                      answer_s=1.0 if case == "other nodes" else 0.0)
    status, alloc = job(plan(tmp_path, spare=1), slurm, TRAINSTACK_IN_PLACE="0" if case == "off" else "1")
    assert ("kill_steps",) in slurm.calls and alloc.files.step.offer_after(0) is None
    if case == "requeue":
        assert status == 1 and len(slurm.launched) == 1, job.said
    else:
        assert status == 0 and "--ntasks=4" in slurm.launched[1], slurm.launched
        assert nodelist(slurm.launched[1]) == ("node1,node3" if case == "other nodes" else "node1,node2")


def test_the_node_pool_chooses_the_first_usable_hosts():
    pool = NodePool(["n1", "n2", "n3", "n4"])
    assert pool.choose(2) == ["n1", "n2"]
    pool.lose(["n2"])
    pool.leave_out(["n1"])
    assert pool.choose(2) == ["n3", "n4"] and pool.choose(3) is None
    pool.readmit(["n1"])
    assert pool.choose(3) == ["n1", "n3", "n4"]


def test_the_driver_needs_nothing_but_the_standard_library():
    """The batch host runs it with whatever Python 3.10+ it has (the copy trainstack submit ships included)."""
    root = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); import trainstack._slurm.allocation; "
            "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'trainstack', "
            "'__main__'}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out


def _silent_driver(folder: Path, host: str = "node1") -> JobFiles:
    """A job folder whose driver started on ``host`` and beat long ago."""
    folder.mkdir(exist_ok=True)
    files = JobFiles(folder)
    files.driver.started(host)
    old = time.time() - 100
    os.utime(files.path(JobFiles.ALIVE), (old, old))
    return files


def test_the_sentinel_asks_slurm_about_a_silent_batch_host_and_tells_a_lost_one_from_a_hung_driver(tmp_path):
    """Issue 66: the heartbeat is read by its changes on the sentinel's clock (another node's may be off: a beat
    100 s old by this clock is no evidence); after ``suspect_s`` without a change the batch host is asked, and one
    that does not answer is lost at once; a driver that beats again is watched on; one silent past ``silent_s`` on
    a host that answers is gone too (hung); a driver that ended stands the sentinel down."""
    from trainstack._slurm.sentinel import watch

    files = _silent_driver(tmp_path)
    lost = FakeSlurm(["node1", "node2"], [], lost=("node1",))
    gone = watch(files, lost, "node1", suspect_s=0.1, silent_s=30, poll_s=0.01, control="node2")
    assert gone is not None and gone.lost and 0.1 < gone.silent < 5, gone
    assert lost.calls == [("each", ("node1", "node2"), "true")]  # beside its own node: a quick answer to compare
    answering = FakeSlurm(["node1", "node2"], [])
    gone = watch(files, answering, "node1", suspect_s=0.05, silent_s=0.3, poll_s=0.01)
    assert gone is not None and not gone.lost and len(answering.calls) >= 2  # asked again while silent
    stop = threading.Event()

    def beats() -> None:
        while not stop.wait(0.02):
            files.driver.beat()
            now = time.time() + 0.5 * (time.time() % 1)  # a changing mtime, whatever the file system's resolution
            os.utime(files.path(JobFiles.ALIVE), (now, now))
        files.driver.ended("exit 0")

    beating = threading.Thread(target=beats)
    beating.start()
    threading.Timer(0.5, stop.set).start()
    assert watch(files, lost, "node1", suspect_s=0.2, silent_s=30, poll_s=0.01) is None  # beat, then ended
    beating.join()
    files.driver.started("node1")
    files.driver.watched_from("node3")  # node2 was taken for lost: the sentinel restarted on node3 watches now
    assert watch(files, lost, "node1", suspect_s=0.01, silent_s=30, poll_s=0.01, control="node2") is None


def test_a_sentinel_that_cannot_take_over_requeues_without_the_batch_host(tmp_path):
    """A driver silent on a host that still answers (hung), or no plan in the job folder: the sentinel records a
    node failure blaming the batch host and requeues the job leaving it out, the hold released; a failed requeue
    is said with Slurm's answer and what to do."""
    from trainstack._slurm.sentinel import Gone
    from trainstack._slurm.takeover import take_over
    from trainstack._slurm.verdict import verdict

    files = _silent_driver(tmp_path)
    assert "no sentinel watches it (one node, or no --requeue)" in verdict("RUNNING", tmp_path, None).summary
    files.record_event("sentinel_start", host="node2", watching="node1", attempt=0)
    assert "the sentinel on node2 takes the driver's place once Slurm finds that host lost" in verdict(
        "RUNNING", tmp_path, None).summary
    slurm = FakeSlurm(["node1", "node2"], [], serving={"node1": True, "node2": True, "node3": True})
    log = tmp_path / "job.out"
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert take_over(files, slurm, "node1", Gone(31, lost=True), "100", 2, 0, log) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the requeue's SIGTERM cannot cut it short
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert slurm.calls == [("requeue", "100"), ("exclude", "100", ("node1",)), ("start_now", "100")]
    assert "cannot take the driver's place (no plan of the job's owner" in log.read_text()
    (row,) = files.verdicts()
    assert row["kind"] == "node failure" and row["blamed"] == "node1" and "batch host lost" in row["cause"]
    assert files.driver.silent_for() is None  # recorded as ended: status stops saying "no driver"
    files = _silent_driver(tmp_path / "failed")
    slurm = FakeSlurm(["node1", "node2"], [], serving={"node1": True, "node2": True, "node3": True})
    slurm.scontrol = [(1, "Invalid job id specified")]
    try:
        assert take_over(files, slurm, "node1", Gone(31, lost=False), "100", 2, 0, log) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert "scontrol requeue 100 failed: Invalid job id specified; trainstack cancel the job" in log.read_text()
    os.utime(files.path(JobFiles.ALIVE), (0, 0))
    assert "the sentinel's requeue failed (Invalid job id specified): trainstack cancel the job" in verdict(
        "RUNNING", tmp_path / "failed", None).summary


@pytest.mark.parametrize("case", ["spare", "shrink", "requeue"])
def test_the_sentinel_takes_a_lost_batch_host_s_place_in_the_allocation(tmp_path, monkeypatch, job, case):
    """Issue 66: node1 (the batch host) lost: the sentinel on node2 becomes the driver -- the dead driver's steps
    killed, node1 left out, the next step on node2 and the spare (or on node2 alone above --min-nodes, or a requeue
    without node1 below it), a new sentinel on another node watching it -- and ends the job itself once the run is
    over (no batch script is left to), its status recorded first: ``status`` reads COMPLETED over Slurm's
    CANCELLED."""
    del job  # asked for its teardown: it restores the signal handlers the driver installs
    from trainstack._slurm.sentinel import Gone
    from trainstack._slurm.status import closed_state
    from trainstack._slurm.takeover import take_over

    p = plan(tmp_path, spare=1 if case == "spare" else 0, **({"min_nodes": 1} if case == "shrink" else {}))
    files = JobFiles.mine(Path(p.job_dir_prefix + "100"))
    files.make_own()
    files.record_event("job_start", attempt=0, step_index=0)
    files.record_event("step_start", attempt=0, step_index=0)
    files.driver.started("node1")
    files.driver.keep_plan(p.to_json())
    hosts = ["node1", "node2", "node3"] if case == "spare" else ["node1", "node2"]
    slurm = FakeSlurm(hosts, [{}], lost=("node1",))
    monkeypatch.delenv("TRAINSTACK_JOB_DIR", raising=False)
    for key, value in {"SLURMD_NODENAME": "node2", "SLURM_JOB_ID": "100", "SLURM_JOB_NUM_NODES": str(len(hosts)),
                       "SLURM_NNODES": "1", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "x",
                       "TRAINSTACK_IN_PLACE": "0"}.items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "job.out"
    log.touch()
    monkeypatch.setattr("trainstack._slurm.takeover._output_to", lambda log: None)  # pytest holds the output
    status = take_over(files, slurm, "node1", Gone(3.5, lost=True), "100", len(hosts), 0, log)
    text = log.read_text()
    assert ("kill_steps",) in slurm.calls
    if case == "requeue":
        assert status == 0 and ("requeue", "100") in slurm.calls and not slurm.launched, slurm.calls
        assert ("exclude", "100", ("node1",)) in slurm.calls and ("scancel", "100") not in slurm.calls
        return
    assert status == 0, text
    assert [nodelist(a) for a in slurm.launched] == ["node2,node3" if case == "spare" else "node2"]
    assert "the driver's place is taken on node2 in this allocation (takeover 1 of 2)" in text
    assert ("sentinel", "node3" if case == "spare" else None) in slurm.calls or case == "shrink"
    assert slurm.calls[-1] == ("scancel", "100")
    kinds = [e["kind"] for e in files.events()]
    assert "driver_lost" in kinds and "driver_takeover" in kinds and kinds[-1] == "job_closed"
    assert files.driver.host()[0] == "node2" and files.exit_code() == "0"
    assert closed_state("CANCELLED", files.folder) == "COMPLETED"
    files.record_event("job_start", attempt=1, step_index=0)  # a later attempt: its own end decides
    assert closed_state("CANCELLED", files.folder) == "CANCELLED"


def test_only_one_sentinel_takes_a_dead_driver_s_place(tmp_path):
    """Two sentinels that both saw the driver go (one on a node partitioned away, say): the first claim wins, the
    other stands down without a step, a requeue or a record."""
    from trainstack._slurm.sentinel import Gone
    from trainstack._slurm.takeover import take_over

    files = _silent_driver(tmp_path)
    assert files.driver.claim(files.driver.host())  # the first sentinel's
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}], lost=("node1",))
    log = tmp_path / "job.out"
    assert take_over(files, slurm, "node1", Gone(4, lost=True), "100", 3, 0, log) == 0
    assert slurm.calls == [] and slurm.launched == [] and not files.verdicts()
    assert "another sentinel has taken the place of the driver on node1: this one stands down" in log.read_text()
    files.driver.started("node2")  # the new driver: its own death is a new claim
    assert files.driver.claim(files.driver.host()) and not files.driver.claim(files.driver.host())


def test_a_sentinel_s_driver_runs_its_steps_with_the_job_s_environment_not_its_own_step_s():
    from trainstack._slurm.sentinel import job_env

    env = job_env({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_NTASKS": "1", "SLURM_NNODES": "1",
                   "SLURM_JOB_NUM_NODES": "3", "SLURM_NODELIST": "node2", "SLURM_JOB_NODELIST": "node[1-3]",
                   "SLURM_PROCID": "0", "SLURM_CPU_BIND": "none", "SLURMD_NODENAME": "node2", "PATH": "/bin"})
    assert env == {"SLURM_JOB_ID": "7", "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODELIST": "node[1-3]",
                   "SLURM_JOB_NODELIST": "node[1-3]", "SLURMD_NODENAME": "node2", "PATH": "/bin"}


def test_a_torchrun_that_forwards_signals_gets_them_asked_for(tmp_path, job):
    """The versions probe runs the job's interpreter in its container; a torchrun that knows --signals-to-handle
    (torch >= 2.9) gets it, so the stop signal reaches its workers; its versions line is the log's header."""
    fake = tmp_path / "probe.py"
    fake.write_text("print('python 3.11 torch 2.13.0 cuda None nccl None')\nprint('torchrun-signals True')\n")
    spec = LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, launcher="torchrun", requeue=True,
                      node_check=False, log_dir=str(tmp_path / "logs"), program=["train.py"])
    built = build_plan(spec)
    p = Plan(**{**built.__dict__, "probe": [sys.executable, str(fake)]})
    alloc = Allocation(p, FakeSlurm(["a", "b"], []), {"SLURM_JOB_ID": "100"}, emit=lambda line, error: None)
    alloc.job.provenance("a:1")
    argv = alloc.command.argv(["a", "b"])
    assert argv[argv.index("--max-restarts=0") + 1] == "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1," \
                                                       "SIGUSR2" and argv[-1] == "train.py"


def test_a_job_without_requeue_runs_one_step_and_ends_with_its_first_failure(tmp_path, job):
    spec = LaunchSpec(setup="multi-node", nodes=2, cpu=True, procs_per_node=2, node_check=False,
                      log_dir=str(tmp_path / "logs"), program=["train.py"])
    p = Plan(**{**build_plan(spec).__dict__, "probe": ["true"]})
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 2, "host": "node2", "code": 3}], "status": 143}])
    status, alloc = job(p, slurm)
    assert status == 3 and len(slurm.launched) == 1 and rows(alloc) == []
    assert "--nodelist=node1,node2" not in slurm.launched[0]  # the whole allocation, as srun gives it
    assert not any(c[0] in ("requeue", "sentinel") for c in slurm.calls)
    assert JobFiles(alloc.files.folder).exit_code() == "3"


@pytest.mark.parametrize("case", ["a silent host beside answers", "no answer at all", "a slow live host"])
def test_a_host_that_does_not_answer_while_its_peers_do_is_not_waited_for_to_the_timeout(case):
    """The failed step's probe: real processes stand in for the trivial srun steps -- one answers at once, one
    fails at once, one never answers: the silent one is given up ANSWER_SETTLE_S after the first answer, not at the
    5 s timeout, and killed; without peers' answers the timeout holds; a slow but live host within the window is
    waited for. The answers reach ``into`` as they come."""
    import subprocess

    from trainstack._slurm.slurmcmd import ANSWER_SETTLE_S, wait_answers

    def procs(**argv: list[str]) -> dict[str, subprocess.Popen[bytes]]:
        return {name: subprocess.Popen(a, stdin=subprocess.DEVNULL) for name, a in argv.items()}

    started = time.monotonic()
    if case == "a silent host beside answers":
        running, seen = procs(node1=["true"], node2=["false"], node3=["sleep", "30"]), {}
        assert wait_answers(running, timeout=5, settle_s=ANSWER_SETTLE_S, into=seen) == {
            "node1": True, "node2": False, "node3": False} == seen
        assert time.monotonic() - started < ANSWER_SETTLE_S + 1.0
        assert running["node3"].returncode is not None  # killed, not left behind
    elif case == "no answer at all":
        assert wait_answers(procs(node1=["sleep", "30"]), timeout=1.0, settle_s=ANSWER_SETTLE_S) == {"node1": False}
        assert 1.0 <= time.monotonic() - started < 2.0
    else:
        slow_peer = procs(node1=["sleep", "0.2"], node2=["sleep", "1.0"])
        assert wait_answers(slow_peer, timeout=5, settle_s=ANSWER_SETTLE_S) == {"node1": True, "node2": True}


def test_the_task_wrapper_records_a_failure_under_its_ranks_global_rank_and_current_step(tmp_path):
    """A step that starts only some ranks names each task's global rank (TRAINSTACK_TASK_RANKS): the exit record
    and the rank log are that rank's. A rank restarted in place says which job step it is in now (steps/): its
    wrapper, started by an earlier step, records a later failure under that step."""
    from trainstack._common.jobfiles import EXIT_RECORD_SH

    note = ("import os, socket; from trainstack._common.jobfiles import JobFiles; "
            "JobFiles.current().step.note_step(socket.gethostname(), os.getppid(), 4); print('hello'); "
            "raise SystemExit(3)")
    env = {**os.environ, "TRAINSTACK_JOB_DIR": str(tmp_path), "SLURM_PROCID": "0", "TRAINSTACK_STEP": "2",
           "TRAINSTACK_TASK_RANKS": "2/3", "SLURMD_NODENAME": "node2"}
    out = subprocess.run(["bash", "-c", EXIT_RECORD_SH, "trainstack-task", "rank", sys.executable, "-c", note],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out
    (record,) = JobFiles(tmp_path).step.exits()
    assert (record.rank, record.code, record.host, record.step) == (3, 3, "node2", 4), record
    assert (tmp_path / "rank-3.out").read_text() == "hello\n"
    files = JobFiles(tmp_path)  # an offer never outlives its step: a requeued job's step 0 would take a stale one
    files.step.offer(1, {"MASTER_PORT": "1"}, [0], 2)
    files.step.clear()
    assert files.step.offer_after(0) is None


def test_the_ladder_is_data_climbed_in_order_and_explained(tmp_path, job, monkeypatch):
    """The rungs are one ordered tuple: --explain prints them in order, and a rung added to the tuple is asked in
    its place (here one before the spare that offers the step on node2 alone -- the next rungs are not asked)."""
    import trainstack._slurm.allocation as driver
    from trainstack._slurm.rungs import LADDER, Retry

    assert [r.name for r in LADDER] == ["in place", "same nodes or a spare", "shrink", "requeue"]
    lines = plan(tmp_path, spare=1, min_nodes=1).explain()
    assert [line.split(",")[0] for line in lines if line.startswith("rung ")] == [
        "rung 1", "rung 2", "rung 3", "rung 4"] and "rung 3, shrink" in "\n".join(lines)

    class Node2Only:
        name = "node2 only"

        def applies(self, p):
            return True

        def holds(self):
            return False

        def offer(self, climb):
            return Retry(["node2", "node1"]) if climb.kind == "crash" else None

        def explain(self, p):
            return "node2 only"

    monkeypatch.setattr(driver, "LADDER", (LADDER[0], Node2Only(), *LADDER[1:]))
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 1, "host": "node1", "code": 137}]}, {}])
    status, _ = job(plan(tmp_path), slurm)
    assert status == 0 and [nodelist(a) for a in slurm.launched] == ["node1,node2", "node2,node1"], slurm.launched


def test_a_driver_taking_over_from_a_dead_one_goes_on_in_the_same_allocation(tmp_path, monkeypatch, job):
    """Issue 66: the keeper's new driver numbers its steps after the dead one's, leaves out the host the dead one
    had found lost, starts no second sentinel and is recorded as a takeover, not a second job start."""
    del job  # asked for its teardown: it restores the signal handlers the driver installs
    p = plan(tmp_path, spare=1)
    files = JobFiles.mine(Path(p.job_dir_prefix + "100"))
    files.make_own()
    for kind, step in (("job_start", 0), ("step_start", 0), ("step_end", 0), ("step_start", 1)):
        files.record_event(kind, attempt=0, step_index=step)
    files.step.write_lost({"node2": [2, 3]})
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}])
    said: list[str] = []
    monkeypatch.delenv("TRAINSTACK_JOB_DIR", raising=False)
    env = {"SLURM_JOB_ID": "100", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "x", "PATH": os.environ["PATH"],
           "TRAINSTACK_IN_PLACE": "0"}
    alloc = Allocation(p, slurm, env, poll_s=0.02, kill_after_s=0.2, emit=lambda line, error: said.append(line),
                       takeover=1)
    assert alloc.run() == 0, said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node3"] and not any(c[0] == "sentinel" for c in
                                                                                 slurm.calls), slurm.calls
    kinds = [(e["kind"], e.get("step_index")) for e in files.events()]
    assert ("driver_takeover", 0) in kinds and ("step_start", 2) in kinds and kinds.count(("job_start", 0)) == 1


@pytest.mark.parametrize("freed", [["node1", "node1"], ["node1", "node1", "node2", "node2"]])
def test_the_job_s_end_frees_memory_checkpoints_only_where_some_may_be_left(tmp_path, job, freed):
    """Issue 66 rider: the end frees the listed memory checkpoints on the nodes the steps ran on (not an idle
    spare) where not every rank freed its own (a finished run's ranks do); where none can be left, no step runs and
    no "not freed" line is said."""
    p = plan(tmp_path, spare=1)
    files = JobFiles.mine(Path(p.job_dir_prefix + "100"))
    files.make_own()
    files.memory.record(Path(f"/dev/shm/trainstack-{os.getuid()}/job-100-abc"))
    for host in freed:
        files.memory.freed_on(host)
    slurm = FakeSlurm(["node1", "node2", "node3"], [{}])
    status, _ = job(p, slurm)
    frees = [c for c in slurm.calls if c[0] == "each" and c[2] == "bash"]
    if len(freed) == 4:
        assert status == 0 and frees == [] and not files.memory.folders(), slurm.calls
    else:
        assert status == 0 and frees == [("each", ("node2",), "bash")], slurm.calls
    assert not any("not freed" in line for line in job.said), job.said


def _taken(alloc: Allocation) -> dict[int, dict]:
    """What each standby the driver ordered was told (tests/_fake_standby.py), by rank."""
    found = [json.loads(p.read_text()) for p in alloc.files.folder.glob("taken-*.json")]
    return {t["rank"]: t for t in found}


@pytest.fixture
def quick_standbys(monkeypatch):
    """Standbys start 0.1 s after a step does (5 s in a job: never beside a step's own imports)."""
    import trainstack._slurm.standby as standby

    monkeypatch.setattr(standby, "SETTLE_S", 0.1)


def test_a_crashed_rank_starts_in_a_warm_standby_beside_the_ranks_waiting_in_place(tmp_path, job, quick_standbys):
    """Issue 68: a standby on each node once step 0 settled; rank 1 killed, the others wait in place: step 1 starts
    no srun -- node1's ready standby is ordered to be rank 1 of step 1 (its rendezvous, counters and the world),
    said and recorded with its pid; the used one is replaced, the idle ones are killed at the end."""
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.2} for r, h in ((0, "node1"), (2, "node2"),
                                                                                   (3, "node2"))]
    slurm = FakeSlurm(["node1", "node2"], [
        {"fail": [{"rank": 1, "host": "node1", "code": 137, "delay": 0.1}], "peer_lost": waiting,
         "continue_in_place": 0.3, "after_ready": 2}])
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE="1", TRAINSTACK_STANDBY="")
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2"], slurm.launched  # no srun for rank 1
    started = [c for c in slurm.calls if c[0] == "standby"]
    assert {c[1] for c in started[:2]} == {"node1", "node2"}, started  # one per training node
    taken = _taken(alloc)
    assert list(taken) == [1] and taken[1]["host"] == "node1" and taken[1]["step"] == 1, taken
    assert taken[1]["env"]["TRAINSTACK_NPROCS"] == "4" and taken[1]["env"]["MASTER_ADDR"] == "node1", taken
    assert f"rank(s) 1 start in warm standby process(es) {taken[1]['pid']} on node1" in job.said, job.said
    (event,) = [e for e in alloc.files.events() if e["kind"] == "standby_taken"]
    assert event["ranks"] == {"1": taken[1]["pid"]} and event["step_index"] == 1, event
    assert ("standby", "node1") in {c[:2] for c in started[2:]}, started  # the used one replaced
    assert not alloc.standbys.idle  # the idle ones killed at the end
    (row,) = rows(alloc)
    assert row["kind"] == "killed (signal 9)" and row["retried"], row


def test_a_whole_step_relaunch_starts_every_rank_in_standbys(tmp_path, job, quick_standbys):
    """Without restarts in place every rank of the failed step starts afresh: with TRAINSTACK_STANDBY=2 (a node's
    ranks) step 1 is four standbys, no srun."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"rank": 1, "host": "node1", "code": 137, "delay": 0.1}],
                                            "after_ready": 4}])
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_STANDBY="2")
    assert status == 0, job.said
    assert len(slurm.launched) == 1, slurm.launched
    taken = _taken(alloc)
    assert sorted(taken) == [0, 1, 2, 3], taken
    assert {r: t["host"] for r, t in taken.items()} == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}, taken
    assert all(t["step"] == 1 and t["env"]["TRAINSTACK_NPROCS"] == "4" for t in taken.values()), taken


def test_a_broken_standby_is_said_and_never_blocks_a_recovery(tmp_path, job, quick_standbys):
    """Standbys that end before they are ready: each said, none started again on a node after two; the crashed
    rank then starts afresh in an srun of its own, said."""
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.6} for r, h in ((0, "node1"), (2, "node2"),
                                                                                   (3, "node2"))]
    slurm = FakeSlurm(["node1", "node2"], [
        {"fail": [{"rank": 1, "host": "node1", "code": 137, "delay": 0.5}], "peer_lost": waiting, "after_broken": 4,
         "continue_in_place": 0.3}, {"duration": 0.2}])
    slurm.standby = {"broken": True}
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE="1", TRAINSTACK_STANDBY="")
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1"], slurm.launched
    assert "a warm standby on node1 ended before it was ready (exit status 3): starting another" in job.said
    assert "a warm standby on node1 ended before it was ready (exit status 3); no more standbys on that node: its " \
           "ranks start afresh" in job.said, job.said
    assert "0 warm standby(s) ready on node1 for its 1 rank(s): the step's ranks start afresh" in job.said
    assert len([c for c in slurm.calls if c[:2] == ("standby", "node1")]) == 2, slurm.calls


@pytest.mark.parametrize("value, count", [("", 1), ("0", 0), ("off", 0), ("3", 3), ("many", 0)])
def test_standbys_per_node_take_a_count_or_off(tmp_path, job, value, count):
    """TRAINSTACK_STANDBY: unset 1 per training node, a count, 0/off; anything else is said, and off."""
    slurm = FakeSlurm(["node1", "node2"], [{"duration": 0.1}])
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_STANDBY=value)
    assert status == 0 and alloc.standbys.enabled is (count > 0) and (not count or alloc.standbys.count == count)
    assert ("not a count of standbys" in " ".join(job.said)) is (value == "many"), job.said


def test_standbys_are_for_python_programs_under_srun_or_torchrun():
    """A standby becomes a rank of a script or a module, under srun or torchrun (the interpreter before torchrun's
    module, the container's prefix kept); an executable or a custom launcher's command starts its own processes."""
    srun = Launch(["srun"], 2, "rank", ["apptainer", "exec", "img", "python3", "-u"], ["train.py", "--lr", "1"])
    assert srun.python_form() == (["apptainer", "exec", "img", "python3", "-u"], ["train.py", "--lr", "1"])
    torchrun = Launch(["srun"], 1, "none", ["/v/bin/python", "-m", "torch.distributed.run", "--nnodes=2"],
                      ["--module", "pkg.train", "x"], torchrun=True)
    assert torchrun.python_form() == (["/v/bin/python", "-u"], ["-m", "pkg.train", "x"])
    assert Launch(["srun"], 1, "none", torchrun.command, ["--no-python", "./run.sh"], torchrun=True).python_form() \
        is None
    assert Launch(["srun"], 2, "rank", [], ["./run.sh"]).python_form() is None  # an executable
    assert Launch(["srun"], 1, "node", ["bash", "-c", 'eval "$CUSTOM_COMMAND"'], []).python_form() is None


def test_a_torchrun_crash_relaunches_every_rank_in_standbys(tmp_path, job, quick_standbys):
    """torchrun: every recovery relaunches the whole step, so a node's ranks wait warm on each node by default;
    the crash's step 1 is four standbys told torchrun's form, no torchrun agent started."""
    slurm = FakeSlurm(["node1", "node2"], [{"fail": [{"unit": "node-0", "host": "node1", "code": 137, "delay": 0.1}],
                                            "after_ready": 4}])
    status, alloc = job(plan(tmp_path, launcher="torchrun"), slurm, TRAINSTACK_STANDBY="")
    assert status == 0, job.said
    assert len(slurm.launched) == 1, slurm.launched
    assert alloc.standbys.count == 2
    started = [c for c in slurm.calls if c[0] == "standby"]
    assert all(c[3] for c in started) and len(started) >= 4, started  # torchrun's worker form
    assert sorted(_taken(alloc)) == [0, 1, 2, 3], _taken(alloc)


def test_a_standby_that_does_not_take_its_order_starts_its_rank_afresh(tmp_path, job, quick_standbys, monkeypatch):
    """A standby killed or stuck after it said it was ready: ordered, silent -- after TAKE_S its srun is killed and
    the rank starts afresh beside the survivors, said; the recovery goes on."""
    import trainstack._slurm.standby as standby

    monkeypatch.setattr(standby, "TAKE_S", 0.3)
    waiting = [{"rank": r, "host": h, "waiting": True, "delay": 0.2} for r, h in ((0, "node1"), (2, "node2"),
                                                                                   (3, "node2"))]
    slurm = FakeSlurm(["node1", "node2"], [
        {"fail": [{"rank": 1, "host": "node1", "code": 137, "delay": 0.1}], "peer_lost": waiting,
         "continue_in_place": 0.3, "after_ready": 2}, {"duration": 0.2}])
    slurm.standby = {"silent": True}
    status, alloc = job(plan(tmp_path), slurm, TRAINSTACK_IN_PLACE="1", TRAINSTACK_STANDBY="")
    assert status == 0, job.said
    assert [nodelist(a) for a in slurm.launched] == ["node1,node2", "node1"], slurm.launched
    assert "--ntasks=1" in slurm.launched[1]
    assert "the warm standby(s) ordered to be rank(s) 1 on node1 did not take the order within 0.3 s: starting " \
           "them afresh" in job.said, job.said
    assert not [e for e in alloc.files.events() if e["kind"] == "standby_taken"]


def test_a_step_that_started_no_srun_reads_its_first_failure_not_success(tmp_path, job):
    """A shrink continues every rank in place: its step has no srun of its own. A survivor that fails in it is
    that step's failure (its task's exit record), retried -- never read as the run's success (the step's status was
    its new srun's, 0 where there is none)."""
    waiting = [{"rank": r, "host": "node1", "waiting": True, "delay": 0.1} for r in (0, 1)]
    slurm = FakeSlurm(["node1", "node2"], [{"peer_lost": waiting, "continue_in_place": 0.2, "fail_in_place": 137},
                                           {"duration": 0.1}], lost=("node2",))
    status, _ = job(plan(tmp_path, min_nodes=1, max_retries=3), slurm, TRAINSTACK_IN_PLACE="1")
    assert status == 0, job.said
    retried = "crash (exit status 137): retrying in this allocation as step 2"
    assert any(line.startswith(retried) for line in job.said), job.said

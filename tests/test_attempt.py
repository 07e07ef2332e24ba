"""The allocation's retry policy after a crash (the driver calls it: tests/test_allocation.py; on Slurm:
tests/slurm/test_verdicts.py): the same root cause again without progress stops the retries; a new cause, or
progress, retries; every attempt leaves a row."""

from __future__ import annotations

import json

import pytest

from trainstack._slurm.attempt import (
    DEFAULT_RETRY_ON,
    FAILURES,
    Context,
    decide,
    exclusions,
    parse_retry_on,
    stopped,
)

ERROR = """epoch 1 | step {step} | loss 0.5
Traceback (most recent call last):
  File "/home/u/train.py", line 9, in <module>
    1 / 0
ZeroDivisionError: division by zero
"""


def test_the_same_cause_without_progress_stops_a_new_one_or_progress_retries(tmp_path):
    rank0 = tmp_path / "rank-0.out"
    rank0.write_text(ERROR.format(step=40))
    first = decide(tmp_path, 1, FAILURES)
    assert (first.go, first.line) == (True, "attempt 0 ended with python error: ZeroDivisionError: division by "
                                            "zero on rank 0 at train.py:9 (<module>); retrying")
    assert first.kind == "crash" and first.blamed is None  # a program's error blames no host
    rank0.write_text(ERROR.format(step=40) + ERROR.format(step=60))  # the next attempt got further: progress
    assert decide(tmp_path, 1, FAILURES, where=Context(attempt=1)).go
    outcome = decide(tmp_path, 1, FAILURES, where=Context(attempt=2))  # failed again at the same step
    go, line = outcome.go, outcome.line
    assert not go and line == ("not retried: python error: ZeroDivisionError: division by zero on rank 0 at "
                               "train.py:9 (<module>), same as attempt 1, no progress (last step 60)")
    rows = [json.loads(line) for line in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in rows] == [0, 1, 2] and [r["step"] for r in rows] == [40, 60, 60]


def test_a_host_fault_blames_the_host_the_failing_rank_ran_on(tmp_path):
    """Rank 3 of two hosts with two ranks each ran on the second host: it is blamed."""
    (tmp_path / "rank-3.out").write_text(ERROR.replace("ZeroDivisionError: division by zero",
                                                       "RuntimeError: CUDA error: an illegal memory access"))
    outcome = decide(tmp_path, 1, where=Context(hosts=["node6", "node7"], procs_per_node=2))
    assert outcome.go and outcome.blamed == "node7"  # the outcome says it: no re-read of the history
    row = json.loads((tmp_path / "verdicts.jsonl").read_text().splitlines()[-1])
    assert row["kind"] == "cuda error" and row["blamed"] == "node7" and row["category"] == "crash"


def test_a_python_error_is_not_retried_by_default_the_policy_names_why(tmp_path):
    (tmp_path / "rank-0.out").write_text(ERROR.format(step=40))
    outcome = decide(tmp_path, 1)
    assert not outcome.go and outcome.line.startswith("not retried: python error: ZeroDivisionError")
    row = json.loads((tmp_path / "verdicts.jsonl").read_text())
    assert row["retried"] is False and "--retry-on 'python error' retries it" in row["decision"]
    (tmp_path / "verdicts.jsonl").unlink()
    assert decide(tmp_path, 1, parse_retry_on("python error,hang")).go  # a profile's choice


def test_retry_on_names_kinds_or_all_or_none_and_refuses_others():
    assert parse_retry_on("all") == FAILURES and parse_retry_on("none") == ()
    assert parse_retry_on(",".join(DEFAULT_RETRY_ON)) == DEFAULT_RETRY_ON
    assert "python error" not in DEFAULT_RETRY_ON and "cuda out-of-memory" not in DEFAULT_RETRY_ON
    with pytest.raises(ValueError, match="'segfault' is not a failure verdict; valid: all, none, time limit"):
        parse_retry_on("hang,segfault")


def test_graceful_stops_are_recorded_and_a_time_limit_without_progress_stops(tmp_path):
    rank0 = tmp_path / "rank-0.out"
    rank0.write_text("epoch 1 | step 10 | loss 0.5\n")
    first = stopped(tmp_path, 0, "timeout")
    assert (first.go, first.line, first.kind) == (True, "attempt 0 stopped gracefully (time limit) at step 10; "
                                                        "continuing", "timeout")
    assert stopped(tmp_path, 0, "preempt", where=Context(attempt=1)).go  # a preemption is never the run's fault
    rank0.write_text("epoch 1 | step 10 | loss 0.5\nepoch 1 | step 20 | loss 0.4\n")
    assert stopped(tmp_path, 0, "timeout", where=Context(attempt=2)).go
    outcome = stopped(tmp_path, 0, "timeout", where=Context(attempt=3))  # no new step before the next limit
    go, line = outcome.go, outcome.line
    assert not go and line.startswith("not requeued: time limit again at step 20, no progress since attempt 2")
    rows = [json.loads(r) for r in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["time limit", "preempted", "time limit", "time limit"]


def test_the_budget_is_the_decision_and_exclusions_keep_what_fits(tmp_path):
    """A retry the budget does not allow is recorded as not retried; of two blamed hosts on a 2-node partition with
    one node needed only the newest is left out, and the other is named as kept; a node Slurm holds out of service
    costs no room; a deleted job folder still gets its decision and row."""
    fault = ERROR.replace("ZeroDivisionError: division by zero", "RuntimeError: CUDA error: an illegal memory access")
    (tmp_path / "rank-0.out").write_text(fault.format(step=10))
    alone = Context(hosts=["pnode1"], need=1, serving={"pnode1": True})
    outcome = decide(tmp_path, 1, limit=1, where=alone)
    assert outcome.go and "could not leave out" not in outcome.line  # said only when a requeue follows
    assert outcome.note == "a requeued attempt could not leave out pnode1 (no other node in the partition for 1 " \
                           "node(s))" and outcome.exclude == []
    assert json.loads((tmp_path / "verdicts.jsonl").read_text())["exclusion_note"] == \
        "a requeued attempt could not leave out pnode1 (no other node in the partition for 1 node(s))"
    (tmp_path / "rank-0.out").write_text(fault.format(step=10) + fault.format(step=20))
    outcome = decide(tmp_path, 1, limit=1, where=alone)  # the budget counted from the recorded attempts
    assert not outcome.go and "giving up after 1 earlier retries (--max-retries 1)" in outcome.line
    rows = [json.loads(line) for line in (tmp_path / "verdicts.jsonl").read_text().splitlines()]
    assert [r["retried"] for r in rows] == [True, False] and rows[0]["excluded"] == []
    assert exclusions(["n2", "n3"], {"n1": True, "n2": True, "n3": True}, 2) == (
        ["n3"], "a requeued attempt could not leave out n2 (no other node in the partition for 2 node(s))")
    assert exclusions(["n2", "n3"], {"n1": True, "n2": False, "n3": True}, 2) == (
        ["n2"], "a requeued attempt could not leave out n3 (no other node in the partition for 2 node(s))")
    gone = tmp_path / "gone"
    gone.mkdir()
    assert not stopped(gone, 0, "timeout", 0).go
    assert (gone / "verdicts.jsonl").exists()


def test_a_recovery_is_read_back_with_its_phases_and_steps_lost(tmp_path):
    """A crash retried in the allocation: the decision blames the lost host for the next step, and ``recoveries``
    reads the phases from the events the driver and the trainer recorded."""
    from trainstack._common.jobfiles import JobFiles
    from trainstack._slurm.attempt import describe, recoveries

    (tmp_path / "rank-0.out").write_text("epoch 1 | step 23 | loss 0.5\n")
    JobFiles(tmp_path).step.write_lost({"node2": [2, 3]})
    (tmp_path / "exits").mkdir()
    (tmp_path / "exits" / "rank-0").write_text("100.0 1 rank-0 node1\n")
    outcome = decide(tmp_path, 1)
    assert outcome.go and "ended with node failure: node lost: node2" in outcome.line, outcome
    row = json.loads((tmp_path / "verdicts.jsonl").read_text())
    assert row["blamed"] == "node2"
    assert row["step_index"] == 0 and row["fault_time"] == 100.0 and row["step"] == 23, row
    decided = row["time"]
    events = [("detected", 100.5, {"attempt": 0, "step_index": 0}), ("relaunch", decided + 1, {"attempt": 0,
              "step_index": 1, "nodes": "node1,node3"}), ("restoring", decided + 4, {}),
              ("standby_taken", decided + 1.1, {"attempt": 0, "step_index": 1, "ranks": {"2": 71, "3": 72, "x": 1}}),
              ("resumed", decided + 4.5, {"step": 20}), ("first_step", decided + 5, {"step": 21})]
    with open(tmp_path / "events.jsonl", "a") as fh:
        for kind, when, extra in events:
            fh.write(json.dumps({"kind": kind, "time": when, **extra}) + "\n")
    (rec,) = recoveries(tmp_path)
    assert rec["where"] == "in allocation" and rec["nodes"] == "node1,node3" and rec["steps_lost"] == 3, rec
    assert rec["phases"]["detect"] == 0.5 and rec["phases"]["restore"] == 0.5 and rec["phases"]["first step"] == 0.5
    assert rec["total"] == round(decided + 5 - 100.0, 2)
    assert describe(rec).startswith("recovered in the allocation on node1,node3 in ") and "steps redone: 3" in \
        describe(rec)
    assert rec["warm_ranks"] == [2, 3] and describe(rec).endswith("; rank(s) 2, 3 started in warm standbys"), rec


def test_sinfo_states_say_which_nodes_are_in_service():
    """Down, drained, draining, failing or not responding (``*``) nodes are out of service; a powered-off node
    (``~``) is not: Slurm starts it for a job. A node in two partitions counts once."""
    from trainstack._slurm.slurmcmd import parse_node_states

    found = parse_node_states("node1 idle\nnode2 down*\nnode3 mix\nnode4 idle~\nnode5 drain\nnode6 idle*\n"
                              "node7 drng\nnode8 comp\nnode1 alloc\nnode9 fail\n\n")
    assert found == {"node1": True, "node2": False, "node3": True, "node4": True, "node5": False, "node6": False,
                     "node7": False, "node8": True, "node9": False}


def test_forged_verdict_rows_are_skipped_by_status_attempts(tmp_path):
    """Probe 5 E23: rows without an integer attempt (`x`, `[1]`, {"restart": "a", "kind": 5}) raised KeyError."""
    from trainstack._slurm.attempt import history
    from trainstack._slurm.report import attempt_rows

    (tmp_path / "verdicts.jsonl").write_text('x\n[1]\n{"restart": "a", "kind": 5}\n{"attempt": "1"}\n'
                                            '{"attempt": 0, "step_index": 0, "kind": "crash", "cause": "boom"}\n')
    assert [r["attempt"] for r in history(tmp_path)] == [0]
    assert "attempt 0: boom" in attempt_rows(tmp_path)

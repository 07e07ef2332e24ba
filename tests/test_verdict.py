"""Verdicts from a job's own traces, without a cluster (on Slurm: tests/slurm/test_verdicts.py): the first failing
rank wins over the cascade, each class is recognised, a running job has none."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from trainstack._slurm.verdict import verdict

TRACE = """Traceback (most recent call last):
  File "/home/u/train.py", line 42, in <module>
    main()
  File "/home/u/train.py", line 30, in step
    loss = 1 / 0
{error}
"""
CASCADE = TRACE.replace("line 30, in step", "line 12, in sync").format(
    error="RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")


def _job(tmp_path: Path, ranks: dict[int, str], exit_code: str = "1", extra: dict[str, str] | None = None) -> Path:
    folder = tmp_path / "job-7"
    folder.mkdir(parents=True)
    for rank, text in ranks.items():
        (folder / f"rank-{rank}.out").write_text(text)
    (folder / "exit_code").write_text(exit_code + "\n")
    for name, text in (extra or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_the_first_failing_rank_not_the_cascade(tmp_path):
    prefixed = "".join(f"[rank1]: {line}\n" for line in TRACE.format(error="ZeroDivisionError: division by zero")
                       .splitlines())  # as torch prints a rank's uncaught error
    folder = _job(tmp_path, {0: CASCADE, 1: prefixed, 2: CASCADE, 3: "ok\n"})
    v = verdict("FAILED", folder, None)
    assert v.kind == "python error" and v.rank == 1
    assert "ZeroDivisionError: division by zero on rank 1 at train.py:30 (step)" in v.summary
    assert "ranks 0, 2 failed after it" in v.summary and v.hints


def test_each_class(tmp_path):
    oom = _job(tmp_path / "a", {2: TRACE.format(error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")})
    assert (verdict("FAILED", oom, None).kind, verdict("FAILED", oom, None).rank) == ("cuda out-of-memory", 2)
    fault = _job(tmp_path / "a2", {0: TRACE.format(error="RuntimeError: CUDA error: an illegal memory access")})
    assert verdict("FAILED", fault, None).kind == "cuda error"
    only_cascade = _job(tmp_path / "b", {0: CASCADE, 1: CASCADE})
    assert verdict("FAILED", only_cascade, None).kind == "collective failure"
    hang = _job(tmp_path / "c", {}, "124", {"run/hang-1/SUMMARY.txt": "trainstack hang report\nrank 3 (node2, pid 9) "
                                            "is at step 5 (forward) in train.py:9 (f)   <- behind the others\n"})
    v = verdict("FAILED", hang, None)
    assert v.kind == "hang" and "rank 3 (node2" in v.summary
    log = tmp_path / "d.out"
    log.write_text("worker rank 1 failed: the process was killed by SIGKILL (killed by the kernel's OOM killer?)\n")
    assert verdict("FAILED", None, log).kind == "killed (signal 9)"
    cancelled = _job(tmp_path / "e", {}, "143", {"cancelled": "1\n"})
    assert verdict("CANCELLED by 0", cancelled, None).kind == "cancelled"
    graceful = tmp_path / "f.out"
    graceful.write_text("Graceful stop at epoch 3, step 120: signal SIGUSR2. Checkpoint ckpt.pt written.\n")
    assert "after a graceful stop" in verdict("TIMEOUT", None, graceful).summary
    assert "without a graceful stop" in verdict("TIMEOUT", None, None).summary
    assert verdict("NODE_FAIL", None, None).kind == "node failure"
    assert verdict("COMPLETED", _job(tmp_path / "g", {0: "DONE\n"}, "0"), None).kind == "completed"
    assert verdict("RUNNING", None, None).kind == "running"
    assert verdict("FAILED", _job(tmp_path / "h", {0: "no traceback\n"}, "3"), None).kind == "unknown"
    signalled = _job(tmp_path / "i", {0: "step 4\n"}, "143")  # scancel / time limit, once Slurm forgot the job
    assert verdict("ENDED (exit 143, SIGTERM: scancel, the time limit or a preemption)", signalled, None).kind \
        == "terminated"
    assert verdict("FAILED", signalled, None, status=143).kind == "unknown"  # an attempt's own status: retry rules
    never = verdict("NEVER RAN", None, None)
    assert never.kind == "never ran" and "never started" in never.summary
    assert "without recording an exit status" in verdict("ENDED (killed: no exit status recorded)", None, None).summary


def test_a_collective_failure_names_the_rank_that_stopped_answering(tmp_path):
    timeout = CASCADE.replace("Connection closed by peer [10.0.0.2]:4242", "Timed out waiting 15000ms for recv "
                              "operation to complete").replace("RuntimeError", "torch.distributed.DistBackendError")
    folder = _job(tmp_path, {0: timeout, 1: "epoch 1 | step 3 | loss 0.5\n", 2: timeout, 3: timeout})
    v = verdict("FAILED", folder, None)
    assert v.kind == "collective failure" and v.rank == 1
    assert v.summary.startswith("rank 1 stopped answering a collective; ranks 0, 2, 3 failed waiting for it")


def test_a_hang_is_the_watchdogs_record_not_a_printed_line(tmp_path):
    """The watchdog records its report in the job folder's events.jsonl (its SUMMARY.txt lives in the run folder,
    which may be anywhere); the same words printed by a program are no hang."""
    report = ("\ntrainstack hang report: no rank made progress for 5 s (hang_timeout=5 s); 4 rank(s), stacks in "
              "/runs/x/hang-1/rank-<r>.txt\nrank 1 (node1, pid 77) is at step 4 (forward) in stuck (train.py:20)"
              "   <- behind the others\n")
    printed = _job(tmp_path / "a", {0: report + TRACE.format(error="ValueError: mine"), 1: ""}, "1")
    assert verdict("FAILED", printed, None).kind == "python error"
    event = json.dumps({"kind": "hang", "time": 1.0, "reason": report.splitlines()[1], "folder": "/runs/x/hang-1",
                        "behind": [report.splitlines()[2]]})
    folder = _job(tmp_path / "b", {0: report, 1: "", 2: "", 3: ""}, "124", {"events.jsonl": event + "\n"})
    v = verdict("FAILED", folder, None)
    assert v.kind == "hang" and v.summary.startswith("rank 1 (node1, pid 77) is at step 4"), v
    assert any("/runs/x/hang-1" in line for line in v.evidence)
    log = tmp_path / "bare.out"  # no job folder at all (a script trainstack did not generate): its printed report
    log.write_text("[rank0]: " + report.replace("\n", "\n[rank0]: "))
    assert verdict("FAILED", None, log).kind == "hang"


def test_only_the_current_attempt_counts(tmp_path):
    """Rank logs are appended across attempts: an earlier attempt's CUDA fault, or an old hang report, is not this
    attempt's verdict; the first task to fail (its exit record) is the failing rank."""
    fault = TRACE.format(error="RuntimeError: CUDA error: an illegal memory access was encountered")
    marker = "=== trainstack: attempt 1 starts at 2026-01-01T00:10:00+00:00\n"
    folder = _job(tmp_path, {0: fault + marker + "epoch 1 | step 9\n", 1: marker + "epoch 1 | step 9\n"}, "137",
                  {"started": "2026-01-01T00:00:00+00:00\n2026-01-01T00:10:00+00:00\n",
                   "exits/rank-1": "1767226300.5 137 rank-1 gpu042\n",
                   "code/runs/x/hang-1/SUMMARY.txt": "rank 0 (laptop, pid 1) <- behind the others\n"})
    v = verdict("FAILED", folder, None)
    assert (v.kind, v.rank, v.host) == ("killed (signal 9)", 1, "gpu042"), v
    (folder / "exits" / "rank-0").write_text("1767226300.1 3 rank-0 gpu041\n")
    v = verdict("FAILED", folder, None)
    assert (v.kind, v.rank, v.host) == ("exited", 0, "gpu041") and "status 3" in v.summary, v


def test_classes_come_from_types_and_anchored_messages_not_words(tmp_path):
    def kind(error: str) -> str:
        folder = _job(tmp_path / str(abs(hash(error))), {0: TRACE.format(error=error), 1: CASCADE})
        return verdict("FAILED", folder, None).kind

    assert kind("KeyError: 'taxid'") == "python error"
    assert kind("RuntimeError: CUDA error: device-side assert triggered") == "python error"
    assert kind("BrokenPipeError: [Errno 32] Broken pipe") == "python error"
    assert kind("RuntimeError: CUDA error: an illegal memory access was encountered") == "cuda error"
    assert kind("RuntimeError: NVRM: Xid 79, GPU has fallen off the bus") == "cuda error"
    assert kind("torch.distributed.DistBackendError: NCCL communicator was aborted") == "collective failure"
    printed = _job(tmp_path / "g", {0: "Graceful stop at epoch 2, step 80: signal SIGUSR2.\n"
                                       + TRACE.format(error="ValueError: x")})
    assert verdict("FAILED", printed, None).kind == "python error"


def test_a_clean_end_after_a_graceful_stop_without_requeue_is_a_time_limit_not_completed(tmp_path):
    log = tmp_path / "job.out"
    log.write_text("Graceful stop at epoch 2, step 80: signal SIGUSR2\ntrainstack: stopped gracefully with a "
                   "complete checkpoint (timeout); not requeued (no --requeue): resubmit with resume='auto'\n")
    v = verdict("COMPLETED", None, log)
    assert v.kind == "time limit" and "not requeued" in v.summary
    log.write_text(log.read_text() + "trainstack: finished (restart count 0)\n")
    assert verdict("COMPLETED", None, log).kind == "completed"


def test_a_node_that_did_not_answer_the_probe_is_lost_whatever_its_peers_printed(tmp_path):
    """The batch script's probe after a failed step (``lost``: host and ranks) decides: node failure naming the
    host, the ranks and the step -- not the collective errors the surviving ranks printed."""
    folder = _job(tmp_path, {0: "epoch 1 | step 23 | loss 0.5\n" + CASCADE, 1: CASCADE, 2: "", 3: ""},
                  extra={"lost": "node2 2,3\n", "exits/rank-0": "1700000000.5 1 rank-0 node1\n"})
    found = verdict("FAILED", folder, None, 1)
    assert found.kind == "node failure" and found.host == "node2", found
    assert found.summary == "node lost: node2 (ranks 2, 3 stopped answering at step 23)", found.summary
    assert "first failure seen: rank 0 (node1), exit status 1" in found.evidence


def test_ranks_whose_heartbeats_stopped_on_a_node_that_answers_are_a_collective_failure(tmp_path):
    event = json.dumps({"kind": "ranks_lost", "time": 1e10, "ranks": [2, 3], "hosts": ["node2"], "step": 40})
    folder = _job(tmp_path, {0: "", 1: CASCADE}, extra={"events.jsonl": event + "\n"})
    found = verdict("FAILED", folder, None, 75)
    assert found.kind == "collective failure" and found.rank == 2 and found.host == "node2", found
    assert found.summary.startswith("ranks 2, 3 (node2) stopped answering at step 40: their heartbeats stopped")


def test_a_worker_torchrun_saw_killed_is_killed_not_its_agents_exit(tmp_path):
    """Under torchrun a task is a node's agent, whose status is 1 for any worker failure: the verdict is the worker
    failure the agents reported first in this attempt (the root cause with the earliest time), rank and signal."""
    def block(when: str, rank: int, code: str) -> str:
        return (f"Root Cause (first observed failure):\n[0]:\n  time      : {when}\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: 1)\n  exitcode  : {code} (pid: 15646)\n  error_file: <N/A>\n"
                f"  traceback : x\n")
    log = tmp_path / "job.out"
    log.write_text(block("2026-11-28_11:25:27", 3, "1") + block("2026-11-28_11:25:24", 1, "-9  (SIGKILL)")
                   + block("2020-01-01_00:00:00", 2, "-11"))  # an earlier attempt's: not this one's
    started = datetime.datetime(2026, 11, 28, 11, 25).astimezone()  # this attempt's start
    folder = _job(tmp_path, {}, extra={"exits/node-0": f"{started.timestamp() + 27} 1 node-0 node1\n",
                                       "started": f"{started.isoformat()}\n"})
    found = verdict("FAILED", folder, log, 1)
    assert found.kind == "killed (signal 9)" and found.rank == 1 and found.host == "node1", found
    (log.parent / "job.out").write_text(block("2026-11-28_11:25:24", 1, "-11"))
    assert verdict("FAILED", folder, log, 1).kind == "crashed (signal)"
    (log.parent / "job.out").write_text(block("2026-11-28_11:25:24", 1, "1"))  # a plain status: the agent's end
    assert verdict("FAILED", folder, log, 1).kind == "exited"


def test_a_writer_another_attempt_took_over_from_is_superseded(tmp_path):
    """Probe 5 B5: its StaleLease traceback read as `exited ... without a traceback` (the type did not end in
    Error)."""
    folder = tmp_path / "job-3"
    folder.mkdir()
    (folder / "rank-0.out").write_text(
        "Traceback (most recent call last):\n  File \"/home/u/st.py\", line 9, in <module>\n    trainer.fit()\n"
        "trainstack._common.lease.StaleLease: another attempt took this run over: s3://b/r is held at epoch 2 by beta "
        "job 7 on b1, and this writer holds epoch 1.\n")
    (folder / "exit_code").write_text("1\n")
    v = verdict("FAILED", folder, None)
    assert v.kind == "superseded" and "held at epoch 2 by beta" in v.summary, v


def test_a_job_whose_driver_died_says_so(tmp_path):
    """Probe 5 A23: the verdict blamed the last rank failure the driver would have recovered; now the driver's
    death is named -- by its keeper's record, or by a job that started and ended without the driver's end."""
    from trainstack._common.jobfiles import JobFiles

    folder = tmp_path / "job-4"
    folder.mkdir()
    files = JobFiles(folder)
    files.mark_started()
    files.driver.started()
    (folder / "rank-1.out").write_text("Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
                                      "RuntimeError: Connection closed by peer\n")
    v = verdict("FAILED", folder, None)  # `why` after the job's end
    assert v.kind == "driver died" and "no driver.ended" in v.summary, v
    assert verdict("FAILED", folder, None, 1).kind == "collective failure"  # the living driver asks of its step
    files.record_event("driver_died", why="killed by SIGKILL", takeover=None, requeued=True)
    v = verdict("FAILED", folder, None, 137)
    assert v.kind == "driver died" and "killed by SIGKILL" in v.summary and "requeued" in v.summary, v

"""The goodput ledger on a hand-written job folder: every second from the submission to the end in one part, a
crash's rollback and recovery, the requeue's queue time, the formulas of the module docstring."""

from __future__ import annotations

import json

from trainstack._common.goodput import PARTS, format_ledger, ledger


def write(folder, events, books, verdicts=()):
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "ledger").mkdir()
    for i, book in enumerate(books):
        (folder / "ledger" / f"{i}.json").write_text(json.dumps(book))
    (folder / "verdicts.jsonl").write_text("".join(json.dumps(v) + "\n" for v in verdicts))


def test_a_crash_retried_in_the_allocation_then_a_requeue(tmp_path):
    ev = lambda kind, t, a=0, k=0, **f: {"kind": kind, "time": t, "attempt": a, "step_index": k, **f}  # noqa: E731
    write(tmp_path, [
        ev("job_start", 10, submitted=1), ev("step_start", 11), ev("node_check", 14, seconds=3.0),
        ev("step_end", 60), ev("step_start", 62, k=1), ev("resumed", 66, step=20), ev("step_end", 100, k=1),
        ev("job_end", 101), ev("job_start", 130, a=1, submitted=110), ev("step_start", 131, a=1),
        ev("step_end", 150, a=1), ev("job_end", 151, a=1)],
        [{"restart": 0, "step_index": 0, "loop_started": 20, "first_beat": 25, "beats": 25,
          "spent": {"forward": 10, "backward": 10, "optimizer": 5, "data": 2.5, "checkpoint": 3, "eval": 1}},
         {"restart": 0, "step_index": 1, "loop_started": 70, "first_beat": 71, "beats": 20,
          "spent": {"forward": 10, "backward": 10, "data": 1, "checkpoint": 2}},
         {"restart": 1, "step_index": 0, "loop_started": 140, "first_beat": 141, "beats": 5,
          "spent": {"forward": 3, "backward": 3, "data": 1}}],
        [{"attempt": 0, "step_index": 0, "kind": "killed (signal 9)", "step": 25, "fault_time": 55.0,
          "retried": True}])
    found = ledger(tmp_path)
    parts = found["parts"]
    assert set(parts) == set(PARTS) and found["total_s"] == 150
    assert abs(sum(parts.values()) - 150) < 0.05, parts
    assert parts["queue"] == 9 + 20  # submit -> start, requeue -> start
    # fault -> the step's end -> its retry's start -> the retry's relaunch and restore (to its loop); the job's end ->
    # the requeue: a crash's whole cost, none of it booked as start-up
    assert parts["recovery"] == 5 + 2 + (70 - 62) + 9
    assert parts["startup"] == 1 + (20 - 11 - 3) + 1 + (140 - 131)  # the driver's set-up, each first step's
    assert found["steps"][1]["parts"]["startup"] == 0 and found["steps"][1]["parts"]["recovery"] == 70 - 62
    assert parts["node_check"] == 3 and parts["eval"] == 1 and parts["checkpoint"] == 5
    step0 = found["steps"][0]["parts"]
    assert step0["startup"] == 20 - 11 - 3 and step0["compile"] == 5 - 1.1  # first step beyond a steady one
    assert step0["rollback"] == round(5 * (25 - 3.9) / 25, 2)  # 5 steps lost x the mean productive step
    assert found["goodput"] == round(parts["productive"] / 150, 4)
    assert format_ledger(found).startswith(f"goodput {100 * found['goodput']:.1f}% of 2m 30s: ")


def test_the_survivors_state_sent_to_a_new_rank_is_a_part_of_its_own_and_nothing_is_rolled_back(tmp_path):
    """Issue 67: a crash in place whose new rank took the survivors' state (a peer_state event of 0.4 s) at the
    step the crash reached: no rollback, the transfer its own part, carved out of the recovery."""
    ev = lambda kind, t, a=0, k=0, **f: {"kind": kind, "time": t, "attempt": a, "step_index": k, **f}  # noqa: E731
    write(tmp_path, [
        ev("job_start", 10, submitted=10), ev("step_start", 11), ev("step_end", 60), ev("step_start", 61, k=1),
        ev("peer_state", 63, step=25, seconds=0.4, bytes=1000), ev("resumed", 64, step=25, origin="live"),
        ev("step_end", 100, k=1), ev("job_end", 101)],
        [{"restart": 0, "step_index": 0, "loop_started": 20, "first_beat": 21, "beats": 25,
          "spent": {"forward": 10, "backward": 10, "optimizer": 5}},
         {"restart": 0, "step_index": 1, "loop_started": 65, "first_beat": 66, "beats": 20,
          "spent": {"forward": 10, "backward": 10}}],
        [{"attempt": 0, "step_index": 0, "kind": "killed (signal 9)", "step": 25, "fault_time": 58.0,
          "retried": True}])
    found = ledger(tmp_path)
    assert found["parts"]["peer_transfer"] == 0.4 and found["steps"][0]["parts"]["rollback"] < 5, found
    assert abs(sum(found["parts"].values()) - found["total_s"]) < 0.05, found


def test_no_timeline_no_ledger(tmp_path):
    assert ledger(tmp_path) is None and ledger(None) is None

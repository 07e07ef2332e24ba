"""The goodput ledger of a job: where its wall time went, across requeues and retries. Torch-free leaf.

Read from its job folder: the driver's timeline in ``events.jsonl`` (``job_start`` with Slurm's submit time,
``step_start``/``step_end`` of each job step, ``node_check``, ``job_end``), rank 0's time per phase of each step
(``ledger/<n>.json``: the watchdog rewrites it every interval) and the verdict rows (``verdicts.jsonl``: the fault
time and last step of a crash). Every second from the first submission to the end (or now) lands in one part:

* ``queue``: submitted (or requeued) until the attempt started;
* ``startup``: the attempt's start until its first job step, and each step's start until its loop began
  (versions probe, imports, rendezvous, model set-up, checkpoint restore), less the node check -- but after a
  crash, that is ``recovery``;
* ``node_check``: the pre-flight node checks;
* ``compile``: the first step's time beyond a steady step (compilation, warm-up);
* ``checkpoint``: training waiting for checkpoint saves (memory, durable, the final one);
* ``eval``: validation and prediction;
* ``data_wait``: waiting for the data loader;
* ``productive``: steps (forward, backward, optimizer) whose results the run kept;
* ``rollback``: steps done and then lost -- redone after a crash (steps lost x the mean step time), and the
  training between rank 0's last record of its time and the crash (lost with it);
* ``recovery``: from a crash's first failing task to the next step's loop -- detection, teardown, probes, the
  decision, and the relaunch and restore of the step after it (in the allocation, or the requeued attempt's
  set-up): what the failure cost; the requeued job's hold is queue time;
* ``peer_transfer``: of that, the survivors sending their live state to the ranks that lacked it (``peer_state``
  events: no checkpoint read, no step redone);
* ``other``: the rest (callbacks, logging, the script's own work, the end of a step after its last ledger).

``goodput`` = productive / total.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from . import jobevents as jobevents
from .jobfiles import JobFiles

__all__ = ["PARTS", "RUN_PARTS", "ledger", "run_ledger", "format_ledger"]

PARTS = ("queue", "startup", "node_check", "compile", "checkpoint", "eval", "data_wait", "productive", "rollback",
         "recovery", "peer_transfer", "other")
_COMPUTE = ("forward", "backward", "optimizer", "step")


def _step_ledgers(folder: Path) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    files = JobFiles(folder)
    for path in files.ledger_files():
        row = files.ledger(path)
        try:
            out[(int(row.get("restart", 0)), int(row.get("step_index", 0)))] = row
        except (AttributeError, TypeError, ValueError, OverflowError):
            continue
    return out


def _step_parts(start: float, end: float, checked: float, book: dict[str, Any] | None,
                crash: dict[str, Any] | None, resumed_next: int | None) -> dict[str, float]:
    """One job step's seconds by part (``other`` the remainder of its span)."""
    parts = dict.fromkeys(PARTS, 0.0)
    parts["node_check"] = checked
    if book is None or book.get("loop_started") is None:  # it never reached its loop
        parts["startup"] = max(0.0, (crash.get("fault_time") or end) - start - checked) if crash else \
            max(0.0, end - start - checked)
    else:
        spent = book.get("spent") or {}
        beats = max(int(book.get("beats") or 0), 1)
        parts["startup"] = max(0.0, book["loop_started"] - start - checked)
        compute = sum(float(spent.get(k, 0.0)) for k in _COMPUTE)
        data = float(spent.get("data", 0.0))
        steady = (compute + data) / beats
        if book.get("first_beat") is not None and beats > 1:
            parts["compile"] = min(max(0.0, book["first_beat"] - book["loop_started"] - steady), compute)
        parts["checkpoint"] = float(spent.get("checkpoint", 0.0))
        parts["eval"] = float(spent.get("eval", 0.0)) + float(spent.get("predict", 0.0))
        parts["data_wait"] = data
        productive = compute - parts["compile"]
        if crash is not None and resumed_next is not None and isinstance(crash.get("step"), int):
            lost = max(0, crash["step"] - resumed_next)
            parts["rollback"] = min(productive, lost * (productive / beats))
        parts["productive"] = productive - parts["rollback"]
        if crash is not None and crash.get("fault_time") and book.get("time"):  # trained after the last record,
            parts["rollback"] += max(0.0, float(crash["fault_time"]) - max(book["time"], book["loop_started"]))
    if crash is not None and crash.get("fault_time"):
        parts["recovery"] = max(0.0, end - max(float(crash["fault_time"]), start))
    parts["other"] = max(0.0, (end - start) - sum(v for k, v in parts.items() if k != "other"))
    return parts


def _attempt_gaps(starts: list[dict[str, Any]], ends: list[dict[str, Any]], first_submit: float,
                  totals: dict[str, float]) -> None:
    """Each attempt's queue wait (submit or requeue to start), and the gap from an attempt's end to its requeue."""
    last_end: float | None = None
    for s in starts:
        submitted = float(s.get("submitted") or 0) or s["time"]
        if last_end is not None:
            submitted = max(submitted, last_end)
            totals["recovery"] += max(0.0, submitted - last_end)
        totals["queue"] += max(0.0, s["time"] - max(submitted, first_submit))
        after = [e["time"] for e in ends if e["time"] >= s["time"]]
        last_end = after[0] if after else None


def _job_steps(evs: list[dict[str, Any]], books: dict[tuple[int, int], dict[str, Any]],
               rows: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
    """Every job step with its span, its parts (``raw`` unrounded) and whether it crashed."""
    resumed = [e for e in evs if e.get("kind") == "resumed"]
    opened = [e for e in evs if e.get("kind") == "step_start"]
    steps = []
    for i, st in enumerate(opened):
        key = (int(st.get("attempt", 0)), int(st.get("step_index", 0)))
        stop = next((e["time"] for e in evs if e.get("kind") == "step_end" and e["time"] >= st["time"]
                     and (int(e.get("attempt", 0)), int(e.get("step_index", 0))) == key), None)
        later = opened[i + 1]["time"] if i + 1 < len(opened) else None
        stop = stop if stop is not None else (later if later is not None else end)
        checked = sum(float(e.get("seconds") or 0) for e in evs if e.get("kind") == "node_check"
                      and st["time"] <= e["time"] <= stop)
        crash = next((r for r in rows if (int(r.get("attempt", 0)), int(r.get("step_index", 0))) == key
                      and r.get("kind") not in ("node check", "time limit", "preempted")), None)
        nxt = next((e.get("step") for e in resumed if e["time"] > stop), None)
        parts = _step_parts(st["time"], stop, checked, books.get(key), crash, nxt)
        steps.append({"attempt": key[0], "step_index": key[1], "start": st["time"], "end": stop,
                      "crashed": crash is not None, "raw": parts, "parts": {k: round(v, 2) for k, v in parts.items()}})
    return steps


def ledger(folder: Path | None, now: float | None = None) -> dict[str, Any] | None:
    """The job's ledger: ``total_s``, ``parts`` (seconds), ``goodput`` (0..1), and ``steps`` (each job step's
    attempt, index, span and parts); None when the folder has no timeline (not a trainstack job)."""
    if folder is None:
        return None
    evs = jobevents.read(folder)
    starts = [e for e in evs if e.get("kind") == "job_start"]
    if not starts:
        return None
    now = time.time() if now is None else now
    ends = [e for e in evs if e.get("kind") == "job_end"]
    ended = bool(ends) and ends[-1]["time"] >= starts[-1]["time"]  # the last attempt has ended too
    end = ends[-1]["time"] if ended else now
    totals = dict.fromkeys(PARTS, 0.0)
    first_submit = float(starts[0].get("submitted") or 0) or starts[0]["time"]
    first_submit = min(first_submit, starts[0]["time"])
    _attempt_gaps(starts, ends, first_submit, totals)
    began = {int(s.get("attempt", 0)): s["time"] for s in starts}
    steps, previous = _job_steps(evs, _step_ledgers(folder), JobFiles(folder).verdicts(), end), None
    for step in steps:
        raw = step.pop("raw")
        after_crash = previous is not None and previous.pop("crashed", False)
        if after_crash:  # a crash's relaunch and restore are what the failure cost, not start-up
            raw["recovery"] += raw["startup"]
            raw["startup"] = 0.0
            step["parts"] = {k: round(v, 2) for k, v in raw.items()}
        for k, v in raw.items():
            totals[k] += v
        if previous is None or previous["attempt"] != step["attempt"]:  # the script's set-up before its first step
            totals["recovery" if after_crash else "startup"] += \
                max(0.0, step["start"] - began.get(step["attempt"], step["start"]))
        elif after_crash:  # the decision and probes between a crashed step and its retry
            totals["recovery"] += max(0.0, step["start"] - previous["end"])
        previous = step
    sent = sum(float(e.get("seconds") or 0) for e in evs if e.get("kind") == "peer_state")
    totals["peer_transfer"] = min(sent, totals["recovery"])  # a part of the recovery, told apart
    totals["recovery"] -= totals["peer_transfer"]
    total = max(end - first_submit, 1e-9)
    covered = sum(totals.values())
    if covered > total:  # rounding of Slurm's one-second submit time
        totals["other"] = max(0.0, totals["other"] - (covered - total))
    totals["other"] += max(0.0, total - sum(totals.values()))  # the script's own time between steps
    return {"total_s": round(total, 2), "parts": {k: round(v, 2) for k, v in totals.items()},
            "goodput": round(totals["productive"] / total, 4), "steps": steps, "ended": ended}


def format_ledger(found: dict[str, Any]) -> str:
    """``goodput 81.2% of 12m 03s: productive 9m 47s, queue 1m 02s, ...`` (the parts that took any time)."""
    parts = [f"{name.replace('_', ' ')} {_short(sec)}" for name, sec in
             sorted(found["parts"].items(), key=lambda kv: -kv[1]) if sec >= 0.05]
    return f"goodput {100 * found['goodput']:.1f}% of {_short(found['total_s'])}: " + ", ".join(parts)


def _short(seconds: float) -> str:
    """``4.2 s``, ``3m 07s``, ``2h 05m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes}m {sec:02d}s" if minutes < 60 else f"{minutes // 60}h {minutes % 60:02d}m"


#: A run across clusters adds three parts to a job's: the queue of a cluster the run then left, the download of
#: its checkpoint at a new cluster, and the first compilation on a cluster the run moved to (a cold cache).
RUN_PARTS = (*PARTS, "pending_elsewhere", "transfer", "cold_cache")


def run_ledger(jobs: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The ledger of one run across clusters from its jobs' own ledgers (``ledger``), each with ``left`` (the run
    moved away while it waited or after it ended), ``moved_in`` (a job on a cluster the run came to) and
    ``download_s`` (its checkpoint download), over the follower's wall time ``wall_s``."""
    totals = dict.fromkeys(RUN_PARTS, 0.0)
    for job in jobs:
        parts = dict((job.get("ledger") or {}).get("parts") or {})
        if job.get("left"):
            totals["pending_elsewhere"] += parts.pop("queue", 0.0)
        transfer = min(float(job.get("download_s") or 0.0), parts.get("startup", 0.0))
        parts["startup"] = parts.get("startup", 0.0) - transfer
        totals["transfer"] += transfer
        if job.get("moved_in"):
            totals["cold_cache"] += parts.pop("compile", 0.0)
        for name, seconds in parts.items():
            totals[name] = totals.get(name, 0.0) + float(seconds)
    covered = sum(totals.values())
    totals["other"] += max(0.0, wall_s - covered)  # the follower's own time: polls, decisions, submissions
    total = max(wall_s, covered, 1e-9)  # hedged jobs overlap
    return {"total_s": round(total, 2), "parts": {k: round(v, 2) for k, v in totals.items()},
            "goodput": round(totals["productive"] / total, 4), "jobs": len(jobs)}

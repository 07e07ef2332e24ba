"""``python -m trainstack._slurm.attempt TASK_DIR STATUS [--retry-on KINDS] [--stopped KIND] [--step N]``: the
batch script's record of an ended attempt (or job step of an allocation), and its retry decision after a crash.

Records the attempt's verdict in ``TASK_DIR/verdicts.jsonl`` (one row per attempt: restart count, verdict, root
cause, the blamed host, the last step the log shows, the decision). A graceful stop (``--stopped timeout|preempt``)
is recorded and continues (a time limit only while each attempt gets further). A crash is retried only when its
verdict is one of ``--retry-on`` (the transient classes by default: ``DEFAULT_RETRY_ON``) and it is not the
same root cause as the previous attempt **without progress** (no later step); otherwise exit 3 with the reason
(``--max-retries`` still bounds the count). When the verdict blames the machine (a CUDA fault, a node failure), a
line ``blame: HOST`` names it for the next step of the allocation, and ``exclude: HOSTS`` the hosts a requeued
attempt should leave out -- every host blamed so far, as long as enough nodes remain. ``recoveries`` reads the
phases of each recovery back (``trainstack status --attempts``). Torch-free, cheap: it reads the job folder (and
``sinfo`` for the node count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .. import _envvars as envvars
from .. import _jobevents as events
from .._files import read_jsonl
from .verdict import HOST_FAULTS, KINDS, exit_records, last_step, verdict

#: Failures worth another attempt by default: the machine's or the network's, not the program's. A Python error or
#: a CUDA out-of-memory fails the same way again; a hang or an unknown end may not (and the same-cause rule stops
#: a repeat without progress).
DEFAULT_RETRY_ON = ("node failure", "collective failure", "killed (signal 9)", "crashed (signal)", "cuda error", "hang",
                    "unknown")
#: The verdicts a crash can get (what --retry-on may name, besides ``all`` and ``none``).
FAILURES = tuple(k for k in KINDS if k not in ("completed", "cancelled", "preempted", "running"))
_STOPPED = {"timeout": "time limit", "preempt": "preempted"}

def parse_retry_on(text: str) -> tuple[str, ...]:
    """``--retry-on``: comma-separated verdict kinds, or ``all`` / ``none``; an unknown kind is a ValueError naming
    the valid ones."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words == ["all"]:
        return FAILURES
    if words in ([], ["none"]):
        return ()
    bad = [w for w in words if w not in FAILURES]
    if bad:
        raise ValueError(f"{', '.join(map(repr, bad))} is not a failure verdict; valid: all, none, "
                         f"{', '.join(FAILURES)}")
    return tuple(words)


def decide(folder: Path, status: int, retry_on: tuple[str, ...] = DEFAULT_RETRY_ON,
           budget: tuple[int, int | None, str] = (0, None, "--max-retries"), step_index: int = 0) -> tuple[bool, str]:
    """(retry?, the line that says why) for the attempt that just crashed with ``status``; recorded in
    ``verdicts.jsonl`` with the decision. ``budget``: (earlier retries of this kind, the limit or None, the option
    that sets it) -- a retry the budget does not allow is recorded as not retried. ``step_index``: the job step of
    this allocation that ended (0: the attempt's first)."""
    found = verdict("FAILED", folder, None, status)
    cause = f"{found.kind}: {found.summary.split(';')[0]}"
    host = found.host or _host_of_rank(found.rank, folder)
    exits = exit_records(folder)  # first first
    record = {"attempt": int(os.environ.get("SLURM_RESTART_COUNT", "0")), "step_index": step_index,
              "kind": found.kind, "summary": found.summary, "cause": cause, "rank": found.rank, "host": host,
              "blamed": host if found.kind in HOST_FAULTS else None, "step": last_step(folder), "status": status,
              "fault_time": exits[0].time if exits else None, "time": time.time()}
    rows = history(folder)
    previous = rows[-1] if rows else None
    retry, line = True, f"attempt {record['attempt']} ended with {cause}; retrying"
    if found.kind not in retry_on:
        retry, line = False, (f"not retried: {cause} ({found.kind} is not a transient failure; --retry-on "
                              f"'{found.kind}' retries it)")
    elif previous is not None and previous.get("cause") == cause:
        before, now = previous.get("step"), record["step"]
        if now is None or (before is not None and now <= before):
            retry, line = False, (f"not retried: {cause}, same as attempt {previous['attempt']}, no progress "
                                  f"(last step {now if now is not None else 'unknown'})")
    count, limit, option = budget
    if retry and limit is not None and count >= limit:
        retry, line = False, f"not retried: {cause}; giving up after {count} earlier retries ({option} {limit})"
    if retry and record["blamed"]:
        record["excluded"], note = exclusions(folder, [r.get("blamed") for r in rows] + [record["blamed"]])
        line += f"; {note}" if note else ""
    _append(folder, {**record, "retried": retry, "decision": line})
    return retry, line


def stopped(folder: Path, status: int, kind: str,
            budget: tuple[int, int | None, str] = (0, None, "--max-requeues")) -> tuple[bool, str]:
    """(continue?, why) for an attempt that stopped gracefully with a checkpoint (``timeout`` before the time
    limit, ``preempt``), recorded like a crash. A preemption always continues; a time-limit stop continues while
    each attempt gets further than the one before (a run that cannot reach a new step within the time limit would
    otherwise requeue forever)."""
    found = _STOPPED.get(kind, kind)
    attempt, step = int(os.environ.get("SLURM_RESTART_COUNT", "0")), last_step(folder)
    rows = history(folder)
    previous = rows[-1] if rows else None
    go, line = True, f"attempt {attempt} stopped gracefully ({found}) at step {step}; continuing"
    if kind == "timeout" and previous is not None and previous.get("kind") == found and \
            (step is None or (previous.get("step") is not None and step <= previous["step"])):
        go, line = False, (f"not requeued: {found} again at step {step}, no progress since attempt "
                           f"{previous['attempt']} (a longer --time, or a smaller first step)")
    count, limit, option = budget
    if go and limit is not None and count >= limit:
        go, line = False, f"not requeued: {found} after {count} earlier requeues ({option} {limit})"
    _append(folder, {"attempt": attempt, "kind": found, "summary": "graceful stop with a checkpoint",
                     "cause": f"{found}: graceful stop", "rank": None, "host": None, "blamed": None, "step": step,
                     "status": status, "time": time.time(), "retried": go, "decision": line})
    return go, line


def node_check_failed(folder: Path, hosts: list[str],
                      budget: tuple[int, int | None, str] = (0, None, "--max-retries")) -> tuple[bool, str]:
    """(requeue?, why) when the pre-flight node check named ``hosts`` and the allocation has no spare for them:
    requeued leaving them out where the partition has other nodes (and the budget allows), else trained on."""
    rows = history(folder)
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    keep, note = exclusions(folder, [*(r.get("blamed") for r in rows), *hosts])
    count, limit, option = budget
    go = bool(set(hosts) & set(keep)) and (limit is None or count < limit)
    named = ", ".join(hosts)
    if go:
        line = f"node check named {named}: no spare in this allocation; requeueing without it"
    elif limit is not None and count >= limit:
        line = f"node check named {named}: training on it anyway ({count} earlier requeues for it, {option} {limit})"
    else:
        line = f"node check named {named}: training on it anyway ({note or 'no node to take its place'})"
    _append(folder, {"attempt": attempt, "step_index": int(os.environ.get(envvars.STEP) or 0),
                     "kind": "node check", "summary": f"the pre-flight node check named {named}",
                     "cause": f"node check: {named}", "rank": None, "host": hosts[0] if hosts else None,
                     "blamed": hosts[0] if go and hosts else None, "step": None, "status": 0, "time": time.time(),
                     "retried": go, "excluded": keep if go else [], "decision": line})
    return go, line


def history(folder: Path) -> list[dict]:
    """The recorded attempts of this job folder, oldest first (a torn last line is skipped)."""
    return read_jsonl(folder / "verdicts.jsonl")


#: A recovery's phases, each ending at the event named: the batch script saw the failure (``detected``), launched
#: the next step (``relaunch``: in this allocation, or the requeued job's first), the trainer began reading the
#: checkpoint (``restoring``), had it (``resumed``), finished its first step (``first_step``).
PHASES = (("detect", "detected"), ("teardown", "relaunch"), ("relaunch", "restoring"), ("restore", "resumed"),
          ("first step", "first_step"))


def recoveries(folder: Path) -> list[dict]:
    """Every retried crash of this job folder with its recovery: where it went on (``in allocation`` or
    ``requeue``), the seconds of each phase in ``PHASES`` (None where an event is missing), the total from the fault
    (the first failing task's exit) to the first resumed step, and the steps lost (the last step the attempt showed
    less the step it resumed at)."""
    rows, evs = history(folder), events.read(folder)
    out = []
    for row in rows:
        if not row.get("retried") or row.get("summary") == "graceful stop with a checkpoint":
            continue
        attempt, index, ended = row.get("attempt", 0), row.get("step_index", 0), float(row.get("time", 0))
        relaunch = _first(evs, "relaunch", ended)
        if relaunch is None:
            continue
        seen = [e for e in evs if e.get("kind") == "detected" and e.get("attempt") == attempt
                and e.get("step_index") == index and e["time"] <= ended]
        times = {"fault": row.get("fault_time"), "detected": seen[-1]["time"] if seen else None,
                 "relaunch": relaunch["time"]}
        after, resumed = relaunch["time"], None
        for kind in ("restoring", "resumed", "first_step"):  # each after the one before
            found = _first(evs, kind, after)
            times[kind] = found["time"] if found else None
            after = found["time"] if found else after
            resumed = found if kind == "resumed" else resumed
        start, phases, last = times["fault"] or times["detected"], {}, times["fault"]
        for name, kind in PHASES:
            phases[name] = round(times[kind] - last, 2) if times[kind] is not None and last is not None else None
            last = times[kind] if times[kind] is not None else last
        lost = max(0, row["step"] - resumed["step"]) if resumed and isinstance(row.get("step"), int) else None
        out.append({"attempt": attempt, "step_index": index, "cause": row.get("cause"),
                    "where": "in allocation" if relaunch.get("attempt") == attempt else "requeue",
                    "nodes": relaunch.get("nodes"), "phases": phases,
                    "total": round(times["first_step"] - start, 2) if times["first_step"] and start else None,
                    "resumed_at": resumed["step"] if resumed else None, "steps_lost": lost,
                    "resumed_from": ("memory" if resumed.get("memory") else "durable checkpoint") if resumed
                    else None})
    return out


def describe(recovery: dict) -> str:
    """One line for a recovery: where, how long from the fault to the first resumed step, each phase, steps lost."""
    total = f" in {recovery['total']:.1f} s" if recovery.get("total") is not None else ""
    phases = ", ".join(f"{name} {sec:.1f} s" for name, sec in recovery["phases"].items() if sec is not None)
    nodes = f" on {recovery['nodes']}" if recovery.get("nodes") else ""
    where = "in the allocation" if recovery["where"] == "in allocation" else "by a requeue"
    lost = f", {recovery['steps_lost']} step(s) lost" if recovery.get("steps_lost") is not None else ""
    source = " from memory" if recovery.get("resumed_from") == "memory" else ""
    at = f"; resumed{source} at step {recovery['resumed_at']}{lost}" if recovery.get("resumed_at") is not None else \
        "; not resumed yet"
    return f"recovered {where}{nodes}{total}" + (f" ({phases})" if phases else "") + at


def _first(evs: list[dict], kind: str, after: float) -> dict | None:
    return next((e for e in evs if e.get("kind") == kind and e["time"] >= after), None)


def _append(folder: Path, record: dict) -> None:
    with open(folder / "verdicts.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")


def exclusions(folder: Path, blamed: list[str | None]) -> tuple[list[str], str]:
    """The hosts the next attempt leaves out -- a blamed host Slurm already holds out of service (down, drained,
    not responding) at no cost, then the most recently blamed first, as many as still leave the job its usable
    nodes -- and a line naming any blamed host it cannot leave out."""
    order = list(dict.fromkeys(h for h in reversed(blamed) if h))
    need = int(os.environ.get("SLURM_NNODES", "1"))
    nodes = _partition_nodes() if order else {}
    gone = [h for h in order if nodes.get(h) is False]
    working = [h for h in order if h not in gone]
    room = max(0, sum(nodes.values()) - need)
    keep, kept_out = gone + working[:room], working[room:]
    note = (f"a requeued attempt could not leave out {', '.join(kept_out)} (no other node in the partition for "
            f"{need} node(s))" if kept_out else "")
    return sorted(keep), note


def excluded(folder: Path) -> list[str]:
    """The hosts the last recorded decision left out (what the batch script passes to the requeued job)."""
    rows = history(folder)
    return list(rows[-1].get("excluded") or []) if rows and rows[-1].get("retried") else []


def _host_of_rank(rank: int | None, folder: Path) -> str | None:
    """The host rank ``rank`` ran on: ranks fill the nodes in order (srun's block layout, torchrun's node ranks)."""
    nodes = _hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    if rank is None or not nodes:
        return os.environ.get("SLURMD_NODENAME")
    ranks = len(list(folder.glob("rank-*.out"))) or len(nodes)
    per_node = max(1, -(-ranks // len(nodes)))
    return nodes[min(rank // per_node, len(nodes) - 1)]


def _hostnames(nodelist: str) -> list[str]:
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


#: sinfo's states of a node the scheduler can give a job; a ``*`` suffix (not responding) takes it out of service,
#: power-saving suffixes (``~`` off, ``#`` powering up) do not: Slurm starts such a node for the job.
_SERVING = ("idle", "mix", "alloc", "comp", "plnd")


def _partition_nodes() -> dict[str, bool]:
    """{host: in service?} for the job's partition, from ``sinfo``: down, drained, failing or not responding
    nodes are not (empty where sinfo cannot be asked)."""
    partition = os.environ.get("SLURM_JOB_PARTITION")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_node_states(out.stdout)


def parse_node_states(text: str) -> dict[str, bool]:
    """``sinfo -h -N -o "%N %t"`` lines as {host: in service?} (a node listed in several partitions once)."""
    nodes: dict[str, bool] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            state = parts[1]
            serving = not state.endswith("*") and state.rstrip("~#!%$@^-") in _SERVING
            nodes[parts[0]] = nodes.get(parts[0], False) or serving
    return nodes


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainstack._slurm.attempt")
    parser.add_argument("folder", type=Path)
    parser.add_argument("status", type=int)
    parser.add_argument("--retry-on", default=",".join(DEFAULT_RETRY_ON))
    parser.add_argument("--stopped", choices=sorted(_STOPPED))
    parser.add_argument("--count", type=int, default=0, help="earlier requeues of this kind")
    parser.add_argument("--limit", default="", help="their limit (empty: none)")
    parser.add_argument("--limit-option", default="--max-retries")
    parser.add_argument("--step", type=int, default=0, help="the job step of this allocation that ended")
    parser.add_argument("--node-check", default="", help="hosts the pre-flight node check named (no spare left)")
    args = parser.parse_args(argv[1:])
    limit = int(args.limit) if args.limit.strip().isdigit() else None
    args.folder.mkdir(parents=True, exist_ok=True)  # a deleted job folder: the decision is still made and said
    if args.node_check:
        go, line = node_check_failed(args.folder, args.node_check.split(","), (args.count, limit, args.limit_option))
        print(line)
        if go:
            print(f"exclude: {','.join(excluded(args.folder))}")
        return 0 if go else 3
    if args.stopped:
        go, line = stopped(args.folder, args.status, args.stopped, (args.count, limit, args.limit_option))
        print(line)
        return 0 if go else 3
    try:
        retry_on = parse_retry_on(args.retry_on)
    except ValueError as exc:
        print(f"--retry-on: {exc}", file=sys.stderr)
        return 2
    folder = args.folder
    retry, line = decide(folder, args.status, retry_on, (args.count, limit, args.limit_option), args.step)
    print(line)
    blamed = history(folder)[-1].get("blamed") if retry else None
    if blamed:  # the next step of this allocation leaves it out
        print(f"blame: {blamed}")
    hosts = excluded(folder) if retry else []
    if hosts:
        print(f"exclude: {','.join(hosts)}")
    return 0 if retry else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))

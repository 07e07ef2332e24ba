"""The retry policy of a job's allocation: the record of each ended attempt (or job step) and what comes next.

The allocation driver (``allocation.py``) calls it as functions. ``decide`` records a crash's verdict in the job
folder's ``verdicts.jsonl`` (one row per attempt: restart count, verdict, root cause, the blamed host, the last step
the log shows, the decision) and retries it only when its verdict is one of the retried kinds (``--retry-on``; the
transient classes by default: ``DEFAULT_RETRY_ON``), it is not the same root cause as the previous attempt **without
progress** (no later step), and ``--max-retries`` allows. ``stopped`` records a graceful stop (a time limit only
continues while each attempt gets further); ``node_check_failed`` a node check that named a node with no spare left.
``exclusions`` picks the hosts a requeued attempt leaves out; ``recoveries`` reads the phases of each recovery back
(``trainstack status --attempts``). Torch-free, cheap: it reads the job folder; the caller asks Slurm.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._common import jobevents as events
from .._common.jobfiles import JobFiles
from .verdict import HOST_FAULTS, KINDS, last_step, verdict

#: Failures worth another attempt by default: the machine's or the network's, not the program's. A Python error or
#: a CUDA out-of-memory fails the same way again; a hang or an unknown end may not (and the same-cause rule stops
#: a repeat without progress).
DEFAULT_RETRY_ON = ("node failure", "collective failure", "killed (signal 9)", "crashed (signal)", "cuda error", "hang",
                    "unknown")
#: The verdicts a crash can get (what --retry-on may name, besides ``all`` and ``none``).
FAILURES = tuple(k for k in KINDS if k not in ("completed", "cancelled", "preempted", "running", "driver died"))
_STOPPED = {"timeout": "time limit", "preempt": "preempted"}
#: What a verdict row is, for the budgets: a crash (--max-retries), a graceful stop at the time limit
#: (--max-requeues), a preemption (no limit), a node check that named a node with no spare (--max-retries).
CATEGORIES = ("crash", "timeout", "preempt", "nodecheck")


@dataclass(frozen=True)
class Budget:
    """Earlier retries of this kind (``count``), their limit (None: none) and the option that sets it."""

    count: int = 0
    limit: int | None = None
    option: str = "--max-retries"

    @property
    def spent(self) -> bool:
        return self.limit is not None and self.count >= self.limit


@dataclass(frozen=True)
class Outcome:
    """What the policy decided of an ended attempt, whole: go on or not, the line that says why, the kind of end
    (``crash``, ``timeout``, ``preempt``, ``nodecheck``), the host it blames, the hosts a requeue leaves out and the
    note on those it could not (no re-read of the history after the call)."""

    go: bool
    line: str
    kind: str = "crash"
    blamed: str | None = None
    exclude: list[str] = field(default_factory=list)
    note: str = ""


@dataclass(frozen=True)
class Context:
    """The attempt being decided: its restart count, the job step of the allocation that ended, the step's hosts
    in rank order, the job's node count and the partition's nodes in service (``Slurm.partition_nodes``)."""

    attempt: int = 0
    step_index: int = 0
    hosts: Sequence[str] = ()
    procs_per_node: int = 1
    need: int = 1
    serving: Mapping[str, bool] = field(default_factory=dict)


def budget(rows: list[dict], category: str, limit: int | None, option: str = "--max-retries") -> Budget:
    """The budget of ``category`` ends given the recorded attempts ``rows``: how many went on, and the limit."""
    return Budget(sum(1 for row in rows if row.get("retried") and row.get("category") == category), limit, option)


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


def check_settings(requeue: bool, nodes: int, max_requeues: int | None, max_retries: int, spare_nodes: int,
                   min_nodes: int | None, retry_on: str) -> tuple[str, str] | None:
    """What is wrong with a job's recovery settings, as (option, why), or None: the policy owns its budgets, and
    spare nodes and a minimum node count only act where a crash is retried (--requeue)."""
    for option, value in (("--max-requeues", max_requeues), ("--max-retries", max_retries),
                          ("--spare-nodes", spare_nodes)):
        if value is not None and value < 0:
            return option, f"{value} is less than 0"
    if spare_nodes and not requeue:
        return "--spare-nodes", ("spare nodes take over from a failed one when a crash is retried: add --requeue (the "
                                 "retry policy: --max-retries, --retry-on)")
    if min_nodes is not None and not 1 <= min_nodes <= nodes:
        return "--min-nodes", f"{min_nodes} is not between 1 and --nodes {nodes}"
    if min_nodes is not None and not requeue:
        return "--min-nodes", "a job continues on the nodes that survive when a crash is retried in its allocation: " \
                              "add --requeue"
    try:
        parse_retry_on(retry_on)
    except ValueError as exc:
        return "--retry-on", str(exc)
    return None


def decide(folder: Path, status: int, retry_on: tuple[str, ...] = DEFAULT_RETRY_ON, limit: int | None = None,
           where: Context = Context(), log: Path | None = None) -> Outcome:
    """The outcome for the attempt that just crashed with ``status`` (``log``: the job's own, where launchers such as
    torchrun's agents report what their workers did); recorded in ``verdicts.jsonl`` with the decision. A retry
    ``--max-retries`` (``limit``) does not allow is recorded as not retried."""
    files = JobFiles(folder)
    found = verdict("FAILED", folder, log, status)
    cause = f"{found.kind}: {found.summary.split(';')[0]}"
    host = found.host or _host_of_rank(found.rank, where)
    record = {"attempt": where.attempt, "step_index": where.step_index, "category": "crash",
              "kind": found.kind, "summary": found.summary, "cause": cause, "rank": found.rank, "host": host,
              "blamed": host if found.kind in HOST_FAULTS else None, "step": last_step(folder), "status": status,
              "fault_time": files.step.first_sign(), "time": time.time()}
    rows = history(folder)
    spent = budget(rows, "crash", limit)
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
    if retry and spent.spent:
        retry, line = False, (f"not retried: {cause}; giving up after {spent.count} earlier retries "
                              f"({spent.option} {spent.limit})")
    exclude: list[str] = []
    note = ""
    if retry:  # what a requeue would leave out (a retry in this allocation leaves the blamed host out of its pool)
        exclude, note = exclusions([r.get("blamed") for r in rows] + [record["blamed"]], where.serving, where.need)
    files.append_verdict({**record, "excluded": exclude, "exclusion_note": note, "retried": retry, "decision": line})
    blamed = record["blamed"]
    return Outcome(retry, line, "crash", blamed if isinstance(blamed, str) else None, exclude, note)


def stopped(folder: Path, status: int, kind: str, limit: int | None = None, where: Context = Context()) -> Outcome:
    """The outcome for an attempt that stopped gracefully with a checkpoint (``timeout`` before the time limit,
    ``preempt``), recorded like a crash. A preemption always continues; a time-limit stop continues while each
    attempt gets further than the one before (a run that cannot reach a new step within the time limit would
    otherwise requeue forever) and ``--max-requeues`` (``limit``, time limits only) allows."""
    found = _STOPPED.get(kind, kind)
    attempt, step = where.attempt, last_step(folder)
    rows = history(folder)
    spent = budget(rows, kind, limit if kind == "timeout" else None, "--max-requeues")
    previous = rows[-1] if rows else None
    go, line = True, f"attempt {attempt} stopped gracefully ({found}) at step {step}; continuing"
    if kind == "timeout" and previous is not None and previous.get("kind") == found and \
            (step is None or (previous.get("step") is not None and step <= previous["step"])):
        go, line = False, (f"not requeued: {found} again at step {step}, no progress since attempt "
                           f"{previous['attempt']} (a longer --time, or a smaller first step)")
    if go and spent.spent:
        go, line = False, (f"not requeued: {found} after {spent.count} earlier requeues ({spent.option} "
                           f"{spent.limit})")
    JobFiles(folder).append_verdict(
        {"attempt": attempt, "step_index": where.step_index, "category": kind, "kind": found,
         "summary": "graceful stop with a checkpoint", "cause": f"{found}: graceful stop", "rank": None, "host": None,
         "blamed": None, "step": step, "status": status, "time": time.time(), "retried": go, "excluded": [],
         "decision": line})
    return Outcome(go, line, kind)


def node_check_failed(folder: Path, hosts: list[str], limit: int | None = None,
                      where: Context = Context()) -> Outcome:
    """The outcome when the pre-flight node check named ``hosts`` and the allocation has no spare for them: requeued
    leaving them out where the partition has other nodes (and ``--max-retries``, ``limit``, allows), else trained
    on."""
    rows = history(folder)
    spent = budget(rows, "nodecheck", limit)
    keep, note = exclusions([*(r.get("blamed") for r in rows), *hosts], where.serving, where.need)
    go = bool(set(hosts) & set(keep)) and not spent.spent
    named = ", ".join(hosts)
    if go:
        line = f"node check named {named}: no spare in this allocation; requeueing without it"
    elif spent.spent:
        line = (f"node check named {named}: training on it anyway ({spent.count} earlier requeues for it, "
                f"{spent.option} {spent.limit})")
    else:
        line = f"node check named {named}: training on it anyway ({note or 'no node to take its place'})"
    JobFiles(folder).append_verdict(
        {"attempt": where.attempt, "step_index": where.step_index, "category": "nodecheck", "kind": "node check",
         "summary": f"the pre-flight node check named {named}", "cause": f"node check: {named}", "rank": None,
         "host": hosts[0] if hosts else None, "blamed": hosts[0] if go and hosts else None, "step": None,
         "status": 0, "time": time.time(), "retried": go, "excluded": keep if go else [], "decision": line})
    return Outcome(go, line, "nodecheck", hosts[0] if go and hosts else None, keep if go else [], note)


def history(folder: Path) -> list[dict]:
    """The recorded attempts of this job folder, oldest first: a torn line, or a row without an integer attempt and
    step index, is skipped (read back as data: a forged row never raises)."""
    rows = []
    for row in JobFiles(folder).verdicts():
        if type(row.get("attempt")) is int and type(row.setdefault("step_index", 0)) is int:
            row["cause"] = str(row.get("cause", row.get("kind", "?")))
            rows.append(row)
    return rows


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
        shrink = next((e for e in evs if e.get("kind") == "shrink" and ended <= e["time"] <= relaunch["time"]), None)
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
        warm = next((e for e in evs if e.get("kind") == "standby_taken" and e.get("attempt") == relaunch.get("attempt")
                     and e.get("step_index") == relaunch.get("step_index")), None)
        out.append({"attempt": attempt, "step_index": index, "cause": row.get("cause"),
                    "where": "in allocation" if relaunch.get("attempt") == attempt else "requeue",
                    "nodes": relaunch.get("nodes"), "phases": phases,
                    "total": round(times["first_step"] - start, 2) if times["first_step"] and start else None,
                    "resumed_at": resumed["step"] if resumed else None, "steps_lost": lost,
                    "resumed_from": _origin(resumed) if resumed else None,
                    "warm_ranks": sorted(int(r) for r in warm["ranks"] if str(r).isdigit() and len(str(r)) < 8)
                    if warm and isinstance(warm.get("ranks"), dict) else [],
                    "shrunk": {"planned": shrink.get("planned"), "why": shrink.get("why")} if shrink else None})
    return out


def describe(recovery: dict) -> str:
    """One line for a recovery: where, how long from the fault to the first resumed step, each phase, steps lost."""
    total = f" in {recovery['total']:.1f} s" if recovery.get("total") is not None else ""
    phases = ", ".join(f"{name} {sec:.1f} s" for name, sec in recovery["phases"].items() if sec is not None)
    nodes = f" on {recovery['nodes']}" if recovery.get("nodes") else ""
    where = "in the allocation" if recovery["where"] == "in allocation" else "by a requeue"
    shrunk = recovery.get("shrunk")
    if shrunk and recovery.get("nodes"):
        count = len(str(recovery["nodes"]).split(","))
        where = f"continued on {count} of {shrunk['planned']} nodes ({shrunk['why']}), {where}"
    lost = f", steps redone: {recovery['steps_lost']}" if recovery.get("steps_lost") is not None else ""
    source = {"memory": " from memory", "live state": " from the survivors' live state"}.get(
        str(recovery.get("resumed_from")), "")
    at = f"; resumed{source} at step {recovery['resumed_at']}{lost}" if recovery.get("resumed_at") is not None else \
        "; not resumed yet"
    verb = "" if shrunk else "recovered "
    warm = recovery.get("warm_ranks") or []
    started = f"; rank(s) {', '.join(map(str, warm))} started in warm standbys" if warm else ""
    return f"{verb}{where}{nodes}{total}" + (f" ({phases})" if phases else "") + at + started


def _origin(resumed: dict) -> str:
    """Where a resumed attempt's state came from: a survivor's live state, the memory checkpoints, or storage."""
    origin = resumed.get("origin") or ("memory" if resumed.get("memory") else "checkpoint")
    return {"live": "live state", "memory": "memory"}.get(str(origin), "durable checkpoint")


def _first(evs: list[dict], kind: str, after: float) -> dict | None:
    return next((e for e in evs if e.get("kind") == kind and e["time"] >= after), None)


def exclusions(blamed: Sequence[str | None], serving: Mapping[str, bool], need: int) -> tuple[list[str], str]:
    """The hosts the next attempt leaves out -- a blamed host Slurm already holds out of service (down, drained,
    not responding) at no cost, then the most recently blamed first, as many as still leave the job its ``need``
    usable nodes of the partition (``serving``: {host: in service?}) -- and a line naming any blamed host it cannot
    leave out."""
    order = list(dict.fromkeys(h for h in reversed(blamed) if h))
    gone = [h for h in order if serving.get(h) is False]
    working = [h for h in order if h not in gone]
    room = max(0, sum(serving.values()) - need)
    keep, kept_out = gone + working[:room], working[room:]
    note = (f"a requeued attempt could not leave out {', '.join(kept_out)} (no other node in the partition for "
            f"{need} node(s))" if kept_out else "")
    return sorted(keep), note


def _host_of_rank(rank: int | None, where: Context) -> str | None:
    """The host rank ``rank`` ran on: ranks fill the step's hosts in order (srun's block layout, torchrun's node
    ranks)."""
    if rank is None or not where.hosts:
        return None
    return where.hosts[min(rank // max(1, where.procs_per_node), len(where.hosts) - 1)]

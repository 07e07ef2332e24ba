"""What a job's nodes and time looked like: the lines ``status`` and ``why`` add, and the attempt report.

``health`` names the nodes the pre-flight checks named and the ranks named stragglers (still slow, or since
recovered) from the job folder's events; ``write_report`` (the allocation driver, at the end of each job step)
writes ``attempt-<restart>.<step>.txt`` and ``.json``: the step's node check, its stragglers, its verdict and the
job's goodput ledger so far. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._common import jobevents as events
from .._common.files import LARGE, atomic_write, read_back_text
from .._common.goodput import format_ledger, ledger
from .._common.jobfiles import JobFiles
from .attempt import history
from .nodecheck import describe as describe_check
from .nodecheck import read_checks

__all__ = ["health", "health_lines", "write_report", "attempt_rows", "retry_line", "attempt_contract"]


def health(folder: Path | None, since: float = 0.0, until: float | None = None) -> dict[str, Any]:
    """The node checks (each: when, how long, what it named) and stragglers (named, cleared) in a time range."""
    if folder is None:
        return {"node_checks": [], "stragglers": []}
    last = float("inf") if until is None else until
    checks = [{"time": c["ended"], "seconds": c["seconds"], "nodes": list(c["figures"]), "named": c["named"],
               "line": describe_check(c)} for c in read_checks(folder) if since <= c.get("ended", 0) <= last]
    slow: dict[int, dict[str, Any]] = {}
    for e in events.read(folder, since):
        if until is not None and e["time"] > until:
            break
        if e.get("kind") == "straggler":
            slow[int(e["rank"])] = {**{k: v for k, v in e.items() if k != "kind"}, "cleared": None}
        elif e.get("kind") == "straggler_cleared" and int(e["rank"]) in slow:
            slow[int(e["rank"])]["cleared"] = e["time"]
    return {"node_checks": checks, "stragglers": list(slow.values())}


def health_lines(folder: Path | None) -> list[str]:
    """``status``/``why``: the last node check that named a node, and every straggler named (with its figures)."""
    found = health(folder)
    lines = []
    named = [c for c in found["node_checks"] if c["named"]]
    if named:
        last = named[-1]
        lines += [f"node check named {host}: {why}" for host, why in last["named"].items()]
    elif found["node_checks"]:
        lines.append(found["node_checks"][-1]["line"])
    for s in found["stragglers"]:
        state = "since recovered" if s["cleared"] else "still slow"
        lines.append(f"straggler: rank {s['rank']} ({s['host']}) {s['ratio']:.1f}x slower in {s['phase']} "
                     f"({s['ms_per_step']:.1f} vs {s['baseline_ms']:.1f} ms per step) from step {s['step']}, "
                     f"{state}")
    return lines


def write_report(folder: Path, restart: int, step_index: int) -> Path:
    """The attempt report of job step ``restart.step_index``: text and JSON in the job folder."""
    found = ledger(folder)
    mine = next((s for s in (found or {}).get("steps", []) if (s["attempt"], s["step_index"]) ==
                 (restart, step_index)), None)
    start = mine["start"] if mine else 0.0
    end = mine["end"] if mine else None
    row = next((r for r in reversed(history(folder)) if (r.get("attempt"), r.get("step_index", 0)) ==
                (restart, step_index)), None)
    seen = health(folder, start, end)
    report = {"attempt": restart, "step_index": step_index, "start": start, "end": end, **seen,
              "verdict": row, "step_parts": mine["parts"] if mine else None, "job_ledger": found}
    files = JobFiles(folder)
    atomic_write(files.report(restart, step_index, ".json"), json.dumps(report, indent=1, default=str))
    lines = [f"trainstack attempt report: attempt {restart}, job step {step_index}"]
    lines += [f"  {c['line']}" for c in seen["node_checks"]] or ["  node check: not run"]
    lines += [f"  node check named {h}: {why}" for c in seen["node_checks"] for h, why in c["named"].items()]
    lines += [f"  straggler: rank {s['rank']} ({s['host']}) {s['ratio']:.1f}x slower in {s['phase']} from step "
              f"{s['step']}{' (recovered)' if s['cleared'] else ''}" for s in seen["stragglers"]] or \
        ["  stragglers: none named"]
    lines.append(f"  verdict: {row['cause']} -> {row.get('decision')}" if row else "  verdict: ended normally")
    if mine:
        parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in mine["parts"].items() if v >= 0.05)
        lines.append(f"  this step: {parts}")
    if found:
        lines.append(f"  job so far: {format_ledger(found)}")
    path = files.report(restart, step_index, ".txt")
    atomic_write(path, "\n".join(lines) + "\n")
    return path


def attempt_rows(folder: Path | None) -> str:
    """``status --attempts``: one row per ended attempt of a requeued job (its verdicts.jsonl), then the hosts left
    out."""
    from .attempt import describe, recoveries

    rows = history(folder) if folder is not None else []
    spent = ledger(folder)
    extra = [f"  {line}" for line in health_lines(folder) + ([format_ledger(spent)] if spent else [])]
    if folder is None or not rows:
        return "\n".join(["  no attempt recorded (verdicts.jsonl is written by --requeue jobs when an attempt ends "
                          "early)", *extra])
    found = {(r["attempt"], r["step_index"]): r for r in recoveries(folder)}
    lines = []
    for r in rows:
        name = f"{r['attempt']}.{r['step_index']}" if r.get("step_index") else f"{r['attempt']}"
        lines.append(f"  attempt {name}: {r['cause']} (last step {r.get('step')}, exit {r.get('status')}"
                     + (f", on {r['host']}" if r.get("host") else "") + ")"
                     + (f" -> {'retried' if r['retried'] else 'stopped'}" if "retried" in r else ""))
        recovery = found.get((r["attempt"], r.get("step_index", 0)))
        if recovery is not None:
            lines.append(f"    {describe(recovery)}")
    if spent:
        lines += [f"  step {st['attempt']}.{st['step_index']}: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.1f} s" for k, v in st["parts"].items() if v >= 0.05) for st in spent["steps"]]
    return "\n".join(lines + extra + [retry_line(folder)]).rstrip()


def retry_line(folder: Path | None) -> str:
    """The retry policy's last word on a job (why it was not retried) and the hosts its attempts left out."""
    from .attempt import history

    rows = history(folder) if folder is not None else []
    lines = [f"  {rows[-1]['decision']}"] if rows and rows[-1].get("retried") is False else []
    left_out = [r for r in rows if r.get("retried") and r.get("excluded")]
    if left_out:
        lines.append(f"  excluded hosts: {', '.join(left_out[-1]['excluded'])} (blamed by a verdict: left out of "
                     f"what followed -- the next step of the allocation, or the requeued attempt)")
    return "\n".join(lines)


def attempt_contract(log: Path | None) -> str | None:
    """What the job's attempt of a run kept from the one before (a run across clusters: the lease epoch it wrote
    as, and which guarantee held), as its log said it."""
    if log is None:
        return None
    text = read_back_text(log, LARGE, owner=None, tail=True, quiet=True)
    said = [line for line in text.splitlines() if "trainstack: this attempt writes " in line]
    return said[-1].split("trainstack: ", 1)[1].strip() if said else None

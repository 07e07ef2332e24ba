"""Facts trainstack itself records in a job folder (``events.jsonl``): a hang report, a graceful stop, a run that
finished. Verdicts read these instead of free text a program could print. Torch-free leaf; outside a trainstack job
(no ``TRAINSTACK_JOB_DIR``) nothing is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .jobfiles import JobFiles

__all__ = ["EVENTS", "record", "read", "step_hosts"]

EVENTS = JobFiles.EVENTS


def record(kind: str, /, **fields: Any) -> None:
    """Append ``{"kind": kind, "time": now, **fields}`` to this job's events (one write; never raises)."""
    files = JobFiles.current()
    if files is not None:
        files.record_event(kind, **fields)


def read(folder: Path | None, since: float = 0.0, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of ``folder`` recorded at or after ``since`` (a Unix time), oldest first; torn lines skipped."""
    if folder is None:
        return []
    return [e for e in JobFiles(Path(folder)).events() if isinstance(e.get("time"), (int, float))
            and e["time"] >= since and (kind is None or e.get("kind") == kind)]


def step_hosts(folder: Path | None) -> list[str]:
    """The nodes a job's steps ran on (its timeline's step events: host names, in order)."""
    hosts: list[str] = []
    for event in read(folder):
        if event.get("kind") in ("step_start", "relaunch", "shrink"):
            for host in str(event.get("nodes") or "").split(","):
                if host and "[" not in host and host not in hosts:
                    hosts.append(host)
    return hosts

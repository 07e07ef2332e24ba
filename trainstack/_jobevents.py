"""Facts trainstack itself records in a job folder (``events.jsonl``): a hang report, a graceful stop, a run that
finished. Verdicts read these instead of free text a program could print. Torch-free leaf; outside a trainstack job
(no ``TRAINSTACK_JOB_DIR``) nothing is written."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from . import _envvars as envvars
from ._files import read_jsonl

__all__ = ["EVENTS", "record", "read"]

EVENTS = "events.jsonl"


def record(kind: str, /, **fields: Any) -> None:
    """Append ``{"kind": kind, "time": now, **fields}`` to this job's events (one write; never raises)."""
    folder = os.environ.get(envvars.JOB_DIR)
    if not folder:
        return
    line = json.dumps({"kind": kind, "time": time.time(), **fields}, default=str) + "\n"
    try:
        fd = os.open(Path(folder) / EVENTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:  # a read-only or deleted job folder must not stop the run
        pass


def read(folder: Path | None, since: float = 0.0, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of ``folder`` recorded at or after ``since`` (a Unix time), oldest first; torn lines skipped."""
    if folder is None:
        return []
    return [e for e in read_jsonl(Path(folder) / EVENTS) if isinstance(e.get("time"), (int, float))
            and e["time"] >= since and (kind is None or e.get("kind") == kind)]

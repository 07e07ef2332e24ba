"""This user's record of the jobs trainstack submitted (``$XDG_STATE_HOME/trainstack/jobs.jsonl``, 0600), so
`trainstack status` lists them after Slurm forgot them. A convenience: the job folder is the source of truth.
Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["index_path", "remember", "records"]


def index_path() -> Path:
    """This user's record of submitted jobs (``$XDG_STATE_HOME/trainstack/jobs.jsonl``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trainstack" / "jobs.jsonl"


def remember(record: dict[str, Any]) -> None:
    """Append one submission (job id, name, folders, log, tasks, launcher); never fails a submission."""
    path = index_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(json.dumps({**record, "submitted": time.time()}) + "\n")
    except OSError:  # the record is a convenience; the job folder is the source of truth
        pass


def records() -> list[dict[str, Any]]:
    """The jobs `trainstack submit` recorded for this user, oldest first (unreadable lines skipped)."""
    path = index_path()
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and str(record.get("job_id", "")).isdigit():
            out.append(record)
    return out

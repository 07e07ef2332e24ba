"""This user's record of the jobs trainstack submitted (``$XDG_STATE_HOME/trainstack/jobs.jsonl``, 0600), so
`trainstack status` lists them after Slurm forgot them. A convenience: the job folder is the source of truth.
Torch-free.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["index_path", "remember", "records", "current_cluster"]

_cluster: list[str | None] = []  # this process's answer, asked once


def index_path() -> Path:
    """This user's record of submitted jobs (``$XDG_STATE_HOME/trainstack/jobs.jsonl``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trainstack" / "jobs.jsonl"


def current_cluster() -> str | None:
    """The cluster Slurm's client commands talk to here (``ClusterName``), None without Slurm; asked once."""
    if not _cluster:
        name = None
        try:
            out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20).stdout
            m = re.search(r"^ClusterName\s*=\s*(\S+)", out, re.MULTILINE)
            name = m.group(1) if m else None
        except (OSError, subprocess.SubprocessError):
            pass
        _cluster.append(name)
    return _cluster[0]


def remember(record: dict[str, Any]) -> None:
    """Append one submission (job id, name, folders, log, tasks, launcher, the cluster); never fails a submission."""
    record = {**record, "cluster": current_cluster()}
    path = index_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a") as fh:
            fh.write(json.dumps({**record, "submitted": time.time()}) + "\n")
    except OSError:  # the record is a convenience; the job folder is the source of truth
        pass


def records() -> list[dict[str, Any]]:
    """The jobs `trainstack submit` recorded for this user on this cluster, oldest first (unreadable lines skipped;
    job ids repeat across clusters, so another cluster's record is never this one's job)."""
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
    here = current_cluster() if out else None
    if here is not None:
        out = [r for r in out if r.get("cluster") in (None, here)]
    return out

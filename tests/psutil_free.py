"""Process-tree helpers from /proc (no psutil dependency): used to prove no worker outlives a test."""

from __future__ import annotations

import os
from pathlib import Path


def children_of(pid: int) -> set[int]:
    """All descendants of ``pid`` that are still alive (zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        nxt = {p for p, pp in parents.items() if pp in frontier} - found
        found |= nxt
        frontier = nxt
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def own_children() -> dict[int, str]:
    """Live descendants of this process, except multiprocessing's long-lived helpers: the resource tracker and the
    workers' fork server (trainstack._runtime.preload; it exits with this process, test_preload.py checks that)."""
    found = {pid: cmdline(pid) for pid in children_of(os.getpid())}
    return {pid: cmd for pid, cmd in found.items()
            if "resource_tracker" not in cmd and "multiprocessing.forkserver" not in cmd}

"""A copy of the code a job runs, taken when it is submitted: editing files while the job waits in the queue (or
between its requeues) does not change what it runs. Torch-free.

The copy holds the git repository's tracked files as they are in the working tree (uncommitted changes included,
submodules' files too) plus untracked files git does not ignore; the job folders themselves are left out, files over
50 MB are linked to the original rather than copied (and named, so the user knows edits to them reach the job), and
the changes are listed, so it is plain what the job runs that no commit records. What the copy lacks at the top of
the submitting folder (ignored data, a venv, ``runs/``, ``logs/``) is linked to the original, so relative paths to
data and outputs still work from the copy. A tracked file that cannot be read stops the snapshot with its name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Snapshot", "SnapshotError", "git_root", "take", "git_state", "ship_driver"]

MAX_FILE_BYTES = 50 * 2**20


class SnapshotError(OSError):
    """The working tree cannot be copied (an unreadable file): nothing was submitted."""


@dataclass
class Snapshot:
    """What was copied: the commit it starts from, what differs from it, and the cost."""

    root: Path
    relative_cwd: str
    commit: str | None
    dirty: bool
    changed: list[str] = field(default_factory=list)
    untracked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)


def git_root(cwd: Path) -> Path | None:
    """The top of the git working tree holding ``cwd`` (None outside one, or without git)."""
    if shutil.which("git") is None:
        return None
    proc = _git(cwd, "rev-parse", "--show-toplevel")
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None


def git_state(root: Path) -> tuple[str | None, list[str], list[str]]:
    """``(commit, changed tracked files, untracked files)``."""
    head = _git(root, "rev-parse", "HEAD")
    commit = head.stdout.strip() if head.returncode == 0 else None
    status = _git(root, "status", "--porcelain", "-z", "--untracked-files=all")
    changed: list[str] = []
    untracked: list[str] = []
    for entry in filter(None, status.stdout.split("\0")):
        code, name = entry[:2], entry[3:]
        (untracked if code == "??" else changed).append(name)
    return commit, changed, untracked


def take(cwd: Path, dest: Path, exclude: list[Path], root: Path | None = None) -> Snapshot:
    """Copy the working tree of the repository holding ``cwd`` (``root``, when the caller found it) into ``dest``
    (see the module docstring)."""
    start = time.perf_counter()
    root = root or git_root(cwd)
    if root is None:
        raise ValueError(f"{cwd} is not inside a git repository")
    commit, changed, untracked = git_state(root)
    tracked = _git(root, "ls-files", "-z", "--cached", "--recurse-submodules")
    others = _git(root, "ls-files", "-z", "--others", "--exclude-standard")
    excluded = [e.resolve() for e in exclude]
    untracked_set = set(untracked)
    snap = Snapshot(root=root, relative_cwd=os.path.relpath(cwd.resolve(), root), commit=commit,
                    dirty=bool(changed or untracked), changed=changed)
    names = dict.fromkeys(filter(None, (tracked.stdout + "\0" + others.stdout).split("\0")))
    for name in names:
        source = root / name
        if not source.is_file() or any(source.resolve().is_relative_to(e) for e in excluded):
            continue  # deleted in the working tree, a submodule folder, or our own job folders
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        size = source.stat().st_size
        if size > MAX_FILE_BYTES:  # linked, not copied: named in the warning and metadata.json
            os.symlink(source.resolve(), target)
            snap.skipped.append(name)
            continue
        try:
            shutil.copy2(source, target)
        except OSError as exc:
            raise SnapshotError(f"cannot copy {source} into the code snapshot: {exc.strerror or exc}. HINT: fix its "
                                f"permissions, add it to .gitignore, or submit with --no-snapshot.") from None
        snap.files += 1
        snap.bytes += size
        if name in untracked_set:
            snap.untracked.append(name)
    here = dest / snap.relative_cwd
    here.mkdir(parents=True, exist_ok=True)
    for entry in sorted(os.scandir(cwd), key=lambda e: e.name):
        if entry.name != ".git" and not os.path.lexists(here / entry.name):
            os.symlink(Path(entry.path).resolve(), here / entry.name)
            snap.linked.append(entry.name)
    snap.seconds = time.perf_counter() - start
    return snap


def ship_driver(dest: Path) -> Path:
    """A copy of this trainstack's Python files in ``dest/trainstack``: the job's batch host runs the allocation
    driver from it when its own Python has no trainstack (a container job on a bare host). The driver is torch-free
    and stdlib-only, so any Python 3.10+ on the host runs it, and it is the version that wrote the job's plan."""
    package = Path(__file__).resolve().parents[1]
    target = dest / package.name
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "templates"))
    return target

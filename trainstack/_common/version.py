"""trainstack's version, and the source a job's plan pins (which code wrote it, so the driver can say when the code
it runs is another)."""

from __future__ import annotations

import functools
from pathlib import Path

__version__ = "0.1.0"

PACKAGE = Path(__file__).resolve().parents[1]  # the trainstack package folder this code runs from


@functools.cache
def source_digest(package: Path = PACKAGE) -> str:
    """sha256 (first 16 hex digits) of the package's Python files, names and contents in name order: the same for
    an editable checkout, an installed wheel and the copy ``trainstack submit`` ships in a job folder."""
    import hashlib  # here: every command line imports this module for __version__

    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" not in path.parts:
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def source_commit(package: Path = PACKAGE) -> str:
    """The git commit of the checkout the package is tracked in (``<sha>`` or ``<sha>+changes``), "" for an
    installed package (a site-packages folder inside someone's repository is not tracked there)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(package.parent), *args], capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""
    if not git("ls-files", "--", f"{package.name}/__init__.py"):
        return ""
    head = git("rev-parse", "--short=12", "HEAD")
    return head and head + ("+changes" if git("status", "--porcelain", "--", package.name) else "")


def source() -> str:
    """What a plan pins: ``sha256:<digest>``, and `` git:<commit>`` where the package is a git checkout."""
    commit = source_commit()
    return f"sha256:{source_digest()}" + (f" git:{commit}" if commit else "")

"""Shared test helpers (a uniquely named module: `import conftest` is ambiguous with nested conftest files)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_exe() -> str:
    return sys.executable


def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun") or "torchrun"


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real, small file system (tmpfs) at ``path`` for full-disk tests; skipped where it cannot be mounted."""
    path.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)

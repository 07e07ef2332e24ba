"""Shared test helpers (a uniquely named module: `import conftest` is ambiguous with nested conftest files)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_exe() -> str:
    return sys.executable


def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    return str(exe) if exe.exists() else shutil.which("torchrun") or "torchrun"

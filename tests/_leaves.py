"""For the fake job steps and standbys of tests/test_allocation.py: import trainstack's torch-free job-folder
protocol (``trainstack._common``) without the package's doors, which ``import trainstack`` loads first (``render``,
``submit``: ~40 ms of CPU a process that a fake rank never uses -- the driver's unit tests start hundreds)."""

from __future__ import annotations

import sys
import types
from pathlib import Path


def without_doors() -> None:
    """Make ``trainstack`` a bare package of this tree's folder, unless it is imported already."""
    if "trainstack" not in sys.modules:
        package = types.ModuleType("trainstack")
        package.__path__ = [str(Path(__file__).resolve().parents[1] / "trainstack")]
        sys.modules["trainstack"] = package

"""Accelerate's behaviours on 2 real gloo processes, under torchrun and under notebook_launcher: the checks in
_accelerate_checks.py (the behaviours Accelerate's own test scripts check, in our words). Four were silently wrong
before: a collective before the first prepare() ran on one process, a shuffled loader lost its own order (2
processes trained a different model than 1), mixed_precision=None and nested/`max` collectives were refused, and
the state/trigger/no_sync surface was missing."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helpers import ROOT, ci_leaves_out, python_exe, torchrun_exe

pytestmark = [pytest.mark.distributed]
SCRIPT = ROOT / "tests" / "distributed" / "_accelerate_checks.py"
ENV = {"PYTHONPATH": str(ROOT / "tests"), "CHECK_RUN": "pytest"}


def _results(lines: str) -> tuple[Counter, list[str]]:
    found = re.findall(r"^CHECK (\w+) (ok|FAIL.*)$", lines, re.M)
    return Counter(name for name, verdict in found if verdict == "ok"), [
        f"{name}: {verdict}" for name, verdict in found if verdict != "ok"]


def _names() -> list[str]:
    return re.findall(r"^@check\ndef (\w+)", SCRIPT.read_text(), re.M)


TORCHRUN = ci_leaves_out("torchrun's workers: tests/distributed/test_launcher.py")


@pytest.mark.parametrize("launch", [pytest.param("torchrun", marks=TORCHRUN), "notebook_launcher"])
def test_accelerate_behaviours_on_two_processes(run_py, tmp_path, launch):
    command = ([torchrun_exe(), "--standalone", "--nproc_per_node", "2", str(SCRIPT)] if launch == "torchrun"
               else [python_exe(), str(SCRIPT), "--spawn"])
    results = tmp_path / "results.txt"
    out = run_py(command, timeout=240, cwd=tmp_path, check=False,
                 env={**ENV, "CHECK_RUN": f"{launch}-{tmp_path.name}", "CHECK_RESULTS": str(results)}).stdout
    passed, failed = _results(results.read_text() if results.exists() else "")
    assert not failed, "\n".join(failed) + "\n" + out[-3000:]
    assert {name: passed[name] for name in _names()} == {name: 2 for name in _names()}, out[-3000:]

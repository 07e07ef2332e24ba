"""A failed rank leaves without the interpreter's teardown (trainstack/_runtime/fastexit.py), in real processes:
what Python's exit would have done first still happens (the traceback, the program's threads, the exit handlers,
open files flushed); what it does last (module teardown, finalizers) does not; Ctrl-C and TRAINSTACK_FAST_EXIT=0
keep Python's own exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
from trainstack._runtime import fastexit

out = Path(sys.argv[1])
fastexit.arm()
fastexit.arm()  # once per process
log = open(out / "user.log", "w")  # never closed: only a flush keeps its line
log.write("a line the program never flushed\\n")
atexit.register(lambda: (out / "atexit").write_text("ran"))

class Teardown:
    def __del__(self):
        (out / "teardown").write_text("ran")

KEEP = Teardown()  # collected only by the interpreter's teardown

def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")

threading.Thread(target=late).start()
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
raise RuntimeError("collective failed: connection closed by peer")
"""


def _run(tmp_path: Path, how: str = "error", **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    return subprocess.run([sys.executable, str(script), str(tmp_path), how], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_failed_rank_says_why_finishes_its_work_and_skips_the_teardown(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 1 and "RuntimeError: collective failed" in done.stderr, done.stderr
    assert (tmp_path / "user.log").read_text() == "a line the program never flushed\n"
    assert (tmp_path / "thread").read_text() == "done"  # the program's own thread was waited for
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown did not run


def test_python_keeps_its_exit_when_asked_and_on_ctrl_c(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    done = _run(plain, TRAINSTACK_FAST_EXIT="0")
    assert done.returncode == 1 and (plain / "teardown").exists() and (plain / "atexit").exists()
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    done = _run(interrupted, "interrupt")
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), done  # Python's own status for Ctrl-C
    assert "KeyboardInterrupt" in done.stderr and (interrupted / "teardown").exists()

"""The allocation driver's keeper (issue 66): a driver that dies without ending the job is said, recorded, its
steps cleaned up and a new driver takes over the allocation; after ``TAKEOVERS`` deaths the job is requeued; the
batch script's stop signals reach the driver. Each case runs the keeper in a process of its own (it forks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainstack._common.jobfiles import JobFiles

pytestmark = pytest.mark.timeout(60)

PROGRAM = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from trainstack._common.jobfiles import JobFiles
    from trainstack._slurm.keeper import Keeper

    folder, behaviour = Path(sys.argv[1]), sys.argv[2]
    files = JobFiles.mine(folder)
    said = []

    def drive(takeover):
        files.driver.started()
        (folder / f"driver-{takeover}").write_text(str(os.getpid()))
        if behaviour == "dies" or (behaviour == "dies-once" and takeover == 0):
            os.kill(os.getpid(), signal.SIGKILL)
        if behaviour == "signal":
            got = []
            signal.signal(signal.SIGUSR2, lambda *_: got.append(1))
            (folder / "ready").write_text("")
            while not got:
                time.sleep(0.01)
            (folder / "got-usr2").write_text("")
        files.driver.ended("exit 0")
        return 0

    keeper = Keeper(files, drive, lambda: (folder / "cleaned").open("a").write("x"),
                    lambda: (folder / "requeued").write_text("") is not None, lambda line, error: print(line))
    sys.exit(keeper.run())
""")


def _run(folder: Path, behaviour: str) -> subprocess.Popen:
    folder.mkdir(mode=0o755, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", PROGRAM, str(folder), behaviour], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_a_driver_killed_is_said_recorded_and_a_new_one_takes_over(tmp_path):
    proc = _run(tmp_path / "job", "dies-once")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "the allocation driver died (killed by SIGKILL) without ending the job" in out and \
        "takeover 1 of 2" in out, out
    files = JobFiles(tmp_path / "job")
    assert [e["kind"] for e in files.events()] == ["driver_died"] and files.events()[0]["why"] == "killed by SIGKILL"
    (row,) = files.verdicts()
    assert row["kind"] == "driver died" and row["category"] == "driver" and row["retried"], row
    assert (tmp_path / "job" / "cleaned").read_text() == "x" and (tmp_path / "job" / "driver-1").exists()


def test_a_driver_that_keeps_dying_has_the_job_requeued(tmp_path):
    proc = _run(tmp_path / "job", "dies")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and (tmp_path / "job" / "requeued").exists(), out
    assert "died (killed by SIGKILL) 3 times in this allocation: the job is requeued" in out, out
    assert JobFiles(tmp_path / "job").driver.has_ended()  # the sentinel stands down


def test_the_batch_scripts_stop_signal_reaches_the_driver(tmp_path):
    """Slurm sends --signal=B:USR2 to the batch script's process: the keeper; the driver acts on it."""
    proc = _run(tmp_path / "job", "signal")
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "job" / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGUSR2)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0 and (tmp_path / "job" / "got-usr2").exists(), out
    assert "driver_died" not in json.dumps(JobFiles(tmp_path / "job").events())

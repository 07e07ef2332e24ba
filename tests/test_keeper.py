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
        files.driver.started(os.uname().nodename)
        (folder / f"driver-{takeover}").write_text(str(os.getpid()))
        if behaviour == "replaced":  # a sentinel took this host for lost and its driver started on node2
            files.driver.started("node2")
            os._exit(75)
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


def _run(folder: Path, behaviour: str, out: Path | None = None) -> subprocess.Popen:
    folder.mkdir(mode=0o755, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", PROGRAM, str(folder), behaviour],
                            stdout=subprocess.PIPE if out is None else out.open("w"), stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def test_a_keeper_whose_driver_another_replaced_stands_aside_until_the_job_ends(tmp_path):
    """A sentinel's driver took the allocation over: the old driver's death is neither cleaned up after (its steps
    are the new driver's now) nor taken over, and the batch script does not end (that would end the job): it waits
    for Slurm's signal."""
    out = tmp_path / "out.txt"
    proc = _run(tmp_path / "job", "replaced", out)
    try:
        deadline = time.monotonic() + 20
        while "driven from node2" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "the allocation is driven from node2 now: this batch script waits for its end" in out.read_text()
        time.sleep(0.3)
        assert proc.poll() is None and not (tmp_path / "job" / "cleaned").exists()
        assert not (tmp_path / "job" / "driver-1").exists() and not JobFiles(tmp_path / "job").events()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_driver_another_replaced_stops_at_its_next_heartbeat(tmp_path):
    """Two drivers of one allocation would fight over its steps: the one a sentinel took for lost stops itself."""
    program = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from trainstack._slurm.batchjob import BatchJob
        from trainstack._slurm.slurmcmd import Slurm
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_allocation import plan
        p = plan(Path(sys.argv[1]))
        job = BatchJob(p, Slurm("100", {{}}), {{"SLURM_JOB_ID": "100", "SLURMD_NODENAME": "node1"}}, None,
                       lambda line, error: print(line, flush=True))
        job.files.make_own()
        job.files.driver.started("node1")
        import threading
        threading.Thread(target=job._heartbeat, daemon=True).start()
        time.sleep(1.5)
        job.files.driver.started("node2")
        time.sleep(10)
        print("still running")
    """)
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 75, proc
    assert "the driver on node2 has taken this allocation over (this host was taken for lost): the driver on node1 " \
           "stops" in proc.stdout and "still running" not in proc.stdout


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

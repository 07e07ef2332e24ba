"""A failed rank leaves without the interpreter's teardown (trainstack/_runtime/fastexit.py), in real processes:
what Python's exit would have done first still happens (the traceback, the program's threads, the exit handlers,
open files flushed); what it does last (module teardown, finalizers) does not; Ctrl-C and TRAINSTACK_FAST_EXIT=0
keep Python's own exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
import atexit, sys, threading, time
from pathlib import Path
from trainstack._runtime import fastexit

out = Path(sys.argv[1])
fastexit.arm(3)
fastexit.arm(3)  # once per process
log = open(out / "user.log", "w")  # never closed: only a flush keeps its line
log.write("a line the program never flushed\\n")
atexit.register(lambda: (out / "atexit").write_text("ran"))

class Teardown:
    def __init__(self, path):
        import os  # its own references: the module's names and the builtins are cleared before it is collected
        self.path, self.open, self.close, self.flags = path, os.open, os.close, os.O_WRONLY | os.O_CREAT

    def __del__(self):
        self.close(self.open(self.path, self.flags, 0o644))

KEEP = Teardown(str(out / "teardown"))  # collected only by the interpreter's teardown

def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")

threading.Thread(target=late).start()
if sys.argv[2] in ("wrapped", "rearmed"):  # a hook like torch's init_process_group's: output held, then prefixed
    import io
    inner = sys.excepthook

    def prefixing(*exc):
        held, sys.stderr = sys.stderr, io.StringIO()
        try:
            inner(*exc)
            text = sys.stderr.getvalue()
        finally:
            sys.stderr = held
        sys.stderr.write("".join(f"[rank0]: {line}" for line in text.splitlines(True)))

    sys.excepthook = prefixing
    if sys.argv[2] == "rearmed":
        fastexit.arm(3)
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[2] == "peer-signalled":  # the launcher's SIGTERM came while the rank unwound: the graceful stop took it
    import os, signal
    from trainstack._runtime.preemption import GracefulStop
    GracefulStop([signal.SIGTERM], None).install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
if sys.argv[2].startswith("peer"):
    raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9604")
raise RuntimeError("collective failed: connection closed by peer")
"""


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    return script


def _run(tmp_path: Path, how: str = "error", **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(_script(tmp_path)), str(tmp_path), how], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_a_failed_rank_says_why_finishes_its_work_and_skips_the_teardown(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 1 and "RuntimeError: collective failed" in done.stderr, done.stderr
    assert (tmp_path / "user.log").read_text() == "a line the program never flushed\n"
    assert (tmp_path / "thread").read_text() == "done"  # the program's own thread was waited for
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # the interpreter's teardown did not run


@pytest.mark.parametrize("how", ["wrapped", "rearmed"])
def test_a_hook_that_wraps_this_one_keeps_its_traceback(tmp_path, how):
    """torch's init_process_group wraps the excepthook (the traceback is held in a buffer, then written with a
    [rank] prefix): wrapped, the hook leaves Python's exit alone (the traceback must not die in the buffer);
    armed again after the wrapper (trainstack arms after init_process_group), it leaves fast with it written."""
    done = _run(tmp_path, how)
    assert done.returncode == 1 and "[rank0]: RuntimeError: collective failed" in done.stderr, done.stderr
    assert (tmp_path / "teardown").exists() == (how == "wrapped")
    assert (tmp_path / "atexit").exists() and (tmp_path / "user.log").read_text().endswith("flushed\n")


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


def test_a_rank_that_failed_because_a_peer_did_says_so_in_its_job_and_waits_before_it_leaves(tmp_path):
    """The first failing task decides the job's status and verdict: in a job, a rank that lost its peer writes the
    driver's signal (peers-lost/rank-<r>: time, step, host) and sleeps (no CPU) before it leaves, so the rank that
    caused it -- perhaps through Python's slower exit -- ends first; outside a job it keeps Python's own exit."""
    from trainstack._common.jobfiles import JobFiles
    from trainstack._runtime import fastexit

    job = tmp_path / "job"
    job.mkdir()
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "RANK"}  # srun sets none: the rank comes from arm()
    done = subprocess.run([sys.executable, str(_script(tmp_path)), str(tmp_path), "peer"], capture_output=True,
                          text=True, timeout=60, env={**env, "PYTHONPATH": str(ROOT), "TRAINSTACK_JOB_DIR": str(job),
                                                      "TRAINSTACK_STEP": "2", "TRAINSTACK_NODE_NAME": "node7"})
    assert done.returncode == 1 and "Connection closed by peer" in done.stderr
    assert time.monotonic() - started >= fastexit.SECONDARY_WAIT_S
    assert not (tmp_path / "teardown").exists()
    assert (job / "peers-lost" / "rank-3").read_text().split()[1:] == ["2", "node7"]
    assert JobFiles(job).step.peers_lost(2) and not JobFiles(job).step.peers_lost(1)
    local = tmp_path / "local"
    local.mkdir()
    done = _run(local, "peer", TRAINSTACK_JOB_DIR="")
    assert done.returncode == 1 and (local / "teardown").exists()  # Python's own exit: the launcher's order kept
    assert fastexit.secondary(RuntimeError, RuntimeError("Connection reset by peer"))
    assert not fastexit.secondary(BrokenPipeError, BrokenPipeError(32, "Broken pipe"))  # the program's own
    assert not fastexit.secondary(ZeroDivisionError, ZeroDivisionError("division by zero"))


def test_a_sigterm_ends_the_wait_of_a_rank_that_lost_its_peer(tmp_path):
    """The launcher's SIGTERM after the first failure (srun's --kill-on-bad-exit; a torchrun agent, which waits for
    its node's other workers before it reports the failure) ends the wait: the rank leaves at once, its exit
    handlers and threads done -- also when the SIGTERM came while it unwound (taken by the graceful stop's flag)."""
    from trainstack._runtime import fastexit

    job = tmp_path / "job"
    job.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "RANK"}, "PYTHONPATH": str(ROOT),
           "TRAINSTACK_JOB_DIR": str(job), "TRAINSTACK_STEP": "0", "TRAINSTACK_NODE_NAME": "node1"}
    proc = subprocess.Popen([sys.executable, str(_script(tmp_path)), str(tmp_path), "peer"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (job / "peers-lost" / "rank-3").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (job / "peers-lost" / "rank-3").exists(), proc.communicate(timeout=30)
        time.sleep(0.1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - signalled < fastexit.SECONDARY_WAIT_S / 2, err
        assert proc.returncode == 128 + signal.SIGTERM and "Connection closed by peer" in err  # as if killed
        assert (tmp_path / "atexit").exists() and (tmp_path / "thread").exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    unwound = tmp_path / "unwound"
    unwound.mkdir()
    done = subprocess.run([sys.executable, str(_script(unwound)), str(unwound), "peer-signalled"],
                          capture_output=True, text=True, timeout=60, env=env)
    said = float((job / "peers-lost" / "rank-3").read_text().split()[0])  # when it said it lost its peer
    assert done.returncode == 128 + signal.SIGTERM and time.time() - said < fastexit.SECONDARY_WAIT_S / 2, done

"""Per-rank logs inside a job: a real process tees its stdout and stderr (Python, C-level and children) into
rank-<r>.out and still passes everything on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PROGRAM = """
import os, subprocess, sys
from trainstack._runtime import ranklog as _ranklog
path = _ranklog.tee_rank_output(3)
print("python stdout", flush=True)
print("python stderr", file=sys.stderr, flush=True)
os.write(1, b"fd-level write\\n")
subprocess.run(["echo", "child process"])
if len(sys.argv) > 1:
    os.kill(os.getpid(), int(sys.argv[1]))
print("last line before exit")
"""


def _run(tmp_path, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTACK_RANK_LOG"}
    env.update({"TRAINSTACK_JOB_DIR": str(tmp_path), **(env_extra or {})})
    return subprocess.run([sys.executable, "-c", PROGRAM, *args], env=env, capture_output=True, text=True, timeout=60)


def test_everything_a_rank_writes_lands_in_its_file_and_on_stdout(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "rank-3.out").read_text()
    for line in ("python stdout", "python stderr", "fd-level write", "child process", "last line before exit"):
        assert line in text and line in proc.stdout  # stderr is merged into the copy, as in the combined log


def test_a_signal_meant_for_the_program_does_not_cut_the_copy_short(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import signal, time, sys\n"
                      "from trainstack._runtime import ranklog as _ranklog\n"
                      "_ranklog.tee_rank_output(0)\n"
                      "signal.signal(signal.SIGUSR2, lambda *a: print('saw USR2', flush=True))\n"
                      "print('ready', flush=True)\n"
                      "time.sleep(1.5)\n"
                      "print('after the signal', flush=True)\n")
    env = {**os.environ, "TRAINSTACK_JOB_DIR": str(tmp_path)}
    env.pop("TRAINSTACK_RANK_LOG", None)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGUSR2)  # the whole group, tee included, as scancel --signal does to a step
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "after the signal" in out
    assert "saw USR2" in (tmp_path / "rank-0.out").read_text()
    assert "after the signal" in (tmp_path / "rank-0.out").read_text()


def test_no_copy_outside_a_job_or_when_the_job_script_already_tees(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRAINSTACK_JOB_DIR"}
    subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, timeout=60, check=True)
    assert not list(tmp_path.iterdir())
    _run(tmp_path, env_extra={"TRAINSTACK_RANK_LOG": str(tmp_path / "by-the-script.out")})
    assert not (tmp_path / "rank-3.out").exists()

"""Workers fork from a preloaded server (trainstack._preload): what they see, what survives, what is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from psutil_free import own_children

from trainstack import Accelerator, _preload

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _inside(_):
    import torch

    return {"ppid": os.getppid(), "dynamo": "torch._dynamo" in sys.modules, "late": os.environ.get("LATE_VAR"),
            "threads": torch.get_num_threads(), "usr2": signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,
            "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}


def test_workers_fork_from_the_preloaded_server_and_see_the_environment_at_launch(monkeypatch):
    monkeypatch.delenv("TRAINSTACK_PRELOAD", raising=False)
    acc = Accelerator(nprocs=2, compute_setup="cpu")  # starts the server
    server = _preload.server_pid()
    assert server and os.path.exists(f"/proc/{server}")
    monkeypatch.setenv("LATE_VAR", "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    got = acc.distribute(_inside)(None)
    assert got["ppid"] == server and got["dynamo"]  # a fork of the server, with torch._dynamo already imported
    assert got["late"] == "set after the server started" and got["threads"] == 1
    assert got["usr2"] and got["term"]  # the server ignores stop signals; its workers do not
    # the server outlives stop signals sent to every process of a job step, and stays usable
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        os.kill(server, sig)
    time.sleep(0.5)
    assert os.path.exists(f"/proc/{server}") and acc.distribute(_inside)(None)["ppid"] == server
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # the launching process is untouched
    assert not own_children()


def test_preload_off_spawns_the_workers(monkeypatch):
    monkeypatch.setenv("TRAINSTACK_PRELOAD", "0")
    got = Accelerator(nprocs=2, compute_setup="cpu").distribute(_inside)(None)
    assert got["ppid"] == os.getpid()  # spawned by this process


_SCRIPT = textwrap.dedent("""
    import os, sys
    from trainstack import Accelerator, _preload

    def where(_):
        return os.getppid()

    if __name__ == "__main__":
        ppid = Accelerator(nprocs=2, compute_setup="cpu").distribute(where)(None)
        print("SERVER", _preload.server_pid(), ppid == _preload.server_pid(), flush=True)
""")


def test_server_exits_with_the_launching_process_and_a_long_tmpdir_still_works(tmp_path):
    long_tmp = tmp_path / ("t" * 60) / ("u" * 40)  # the socket path would not fit AF_UNIX's 107 bytes
    long_tmp.mkdir(parents=True)
    script = tmp_path / "launch.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "TMPDIR": str(long_tmp)}
    env.pop("TRAINSTACK_PRELOAD", None)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, pid, forked = proc.stdout.split()
    assert forked == "True"
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the fork server outlived its launching process"
    # the private folder was removed at exit (torch keeps its compile cache, torchinductor_<user>, there)
    assert [p.name for p in long_tmp.iterdir() if not p.name.startswith("torchinductor_")] == []

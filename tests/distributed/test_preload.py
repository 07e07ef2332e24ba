"""Workers fork from a preloaded server (trainstack._runtime.preload): what they see, what survives, what is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from psutil_free import own_children

from trainstack import Accelerator
from trainstack._runtime import preload as _preload

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
    from trainstack import Accelerator
    from trainstack._runtime import preload as _preload

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


_USER_PROCESSES = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from trainstack import TrainConfig

    def nap(seconds, ready=None):
        if ready:
            open(ready, "w").close()  # inside the target: the process's own signal handlers are in place
        time.sleep(seconds)
        return seconds

    def started(proc, ready):
        import os
        deadline = time.monotonic() + 60
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)

    if __name__ == "__main__":
        TrainConfig(nprocs=2, compute_setup="cpu")  # starts trainstack's (private) fork server
        ctx = mp.get_context("forkserver")
        p = ctx.Process(target=nap, args=(60, sys.argv[1] + "/p"))
        p.start()
        started(p, sys.argv[1] + "/p")
        p.terminate()
        p.join(5)
        print("TERMINATED", not p.is_alive(), flush=True)
        q = ctx.Process(target=nap, args=(60, sys.argv[1] + "/q"))
        q.start()
        started(q, sys.argv[1] + "/q")
        import os, signal
        os.kill(q.pid, signal.SIGINT)
        q.join(5)
        print("INTERRUPTED", not q.is_alive(), flush=True)
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            print("POOL", pool.submit(nap, 0).result(), flush=True)
            worker = next(iter(pool._processes.values()))
            worker.terminate()
            worker.join(5)
            print("POOL-TERMINATED", not worker.is_alive(), flush=True)
        for proc in (p, q):
            if proc.is_alive():
                proc.kill()
""")


def test_the_users_own_forkserver_processes_keep_their_signals(tmp_path, run_py):
    """trainstack's server ignores stop signals; Python's shared one (the default start method from 3.14) must not
    hand that to the user's processes: ours is private."""
    script = tmp_path / "user.py"
    script.write_text(_USER_PROCESSES)
    out = run_py([sys.executable, str(script), str(tmp_path)], timeout=120).stdout
    for marker in ("TERMINATED True", "INTERRUPTED True", "POOL 0", "POOL-TERMINATED True"):
        assert marker in out, out[-3000:]


def _state(_):
    import resource
    import tempfile

    import torch._dynamo.config
    import torch.distributed as dist

    mask = os.umask(0)
    os.umask(mask)
    return {"umask": mask, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "tmp": tempfile.gettempdir(),
            "compile_disabled": torch._dynamo.config.disable, "debug": str(dist.get_debug_level())}


def test_state_set_after_the_config_reaches_the_workers(tmp_path, monkeypatch, caplog):
    import resource

    monkeypatch.delenv("TRAINSTACK_PRELOAD", raising=False)
    for name in ("TORCH_COMPILE_DISABLE", "TORCH_DISTRIBUTED_DEBUG", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    acc = Accelerator(nprocs=2, compute_setup="cpu")  # the server starts now, with today's state
    tmp = tmp_path / "mytmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # read at import: only a warning
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    old_mask = os.umask(0o077)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1000) - 1, hard))
        got = acc.distribute(_state)(None)
    finally:
        os.umask(old_mask)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got["umask"] == 0o077 and got["nofile"] == min(soft, 1000) - 1
    assert got["tmp"].startswith(str(tmp)) and got["compile_disabled"] is True and got["debug"].endswith("DETAIL")
    assert "TORCHINDUCTOR_CACHE_DIR changed after the workers' fork server started" in caplog.text


def test_a_preload_module_that_raises_is_reported_and_skipped(tmp_path, run_py):
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('broken on purpose')\n")
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = {"TRAINSTACK_PRELOAD": "broken_mod", "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    out = run_py([sys.executable, str(script)], env=env, timeout=120).stdout
    assert "preloading 'broken_mod'" in out and "broken on purpose" in out and "SERVER" in out
    assert "EOFError" not in out

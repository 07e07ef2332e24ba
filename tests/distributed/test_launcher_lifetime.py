"""Workers live exactly as long as their launcher wants them, and a worker that ends without finishing is a failure:
no orphans after `kill -9` of the launcher, the run folder stays locked while any worker lives, `sys.exit(0)`,
`os._exit(0)` or a SIGINT that reached only the workers never read as success."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from psutil_free import children_of, cmdline

from trainstack import Callback, TrainConfig, Trainer
from trainstack._train.runfolder import RunFolderBusy, RunLock
from trainstack.errors import WorkerError

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

_LONG_RUN = textwrap.dedent("""
    import sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    from trainstack import Trainer, TrainConfig

    def slow_loss(model, batch):
        time.sleep(0.02)
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    if __name__ == "__main__":
        cfg = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=100000, checkpoint_every=1, hang_timeout=0,
                          log_folder=sys.argv[1], keep_last_checkpoints=2, resume="auto", verbose=False)
        dl = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
        m = torch.nn.Linear(4, 1)
        Trainer(m, torch.optim.SGD(m.parameters(), lr=0.01), cfg, loss_fn=slow_loss).fit(dl)
""")


def _start_long_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "long.py"
    script.write_text(_LONG_RUN)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob("ckpt-*.pt")) if (run / "checkpoints").is_dir() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its first checkpoint"
        time.sleep(0.2)
    return proc, run


def _tree(pid: int) -> set[int]:
    return {p for p in children_of(pid) if "resource_tracker" not in cmdline(p)}


def _workers(launcher: int) -> list[int]:
    """The workers: children of the fork server (a fork keeps its parent's command line, so ask for the parent)."""
    return [p for p in _tree(launcher) if _ppid(p) != launcher]


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


@pytest.mark.alone  # the workers' end within seconds
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_and_the_fork_server_die_with_a_killed_launcher(tmp_path, sig):
    proc, run = _start_long_run(tmp_path)
    tree = _tree(proc.pid)
    assert len(tree) >= 3, "expected the fork server and two workers"  # server + 2 workers
    os.kill(proc.pid, sig)
    killed = time.monotonic()
    proc.wait(30)
    while any(os.path.exists(f"/proc/{p}") and "Z" not in _state(p) for p in tree):
        assert time.monotonic() - killed < 10, f"left running: {[cmdline(p) for p in tree]}"
        time.sleep(0.05)
    took = time.monotonic() - killed
    print(f"launcher {sig.name}: last worker gone {took:.2f} s later")
    assert took < 5
    _lock_is_freed(run, killed)


def _lock_is_freed(run: Path, since: float, within: float = 5.0) -> None:
    """The run folder is free again soon, so a rerun can resume. A killed process's other threads may outlive its
    main thread (shown as a zombie) by a few milliseconds, holding its descriptors until they end."""
    while True:
        try:
            lock = RunLock(run)
            lock.acquire()
            break
        except RunFolderBusy:
            assert time.monotonic() - since < within, "the run folder stayed locked after every process died"
            time.sleep(0.05)
    lock.release()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_run_folder_stays_locked_while_any_worker_lives(tmp_path):
    proc, run = _start_long_run(tmp_path)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    try:
        for pid in workers:  # frozen workers cannot exit yet: they still hold the lock after the launcher dies
            os.kill(pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        with pytest.raises(RunFolderBusy, match="in use by another run"):
            RunLock(run).acquire()
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    released = time.monotonic()
    while any(_state(p) not in ("Z",) for p in workers):
        assert time.monotonic() < released + 10, "the workers outlived their launcher"
        time.sleep(0.05)
    _lock_is_freed(run, released, within=15)


def _exit_zero(trainer, config, writer):
    sys.exit(0)


def _os_exit_rank1(trainer, config, writer):
    if trainer.accelerator.rank == 1:
        os._exit(0)


def _fit(tmp_path, callback):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    cfg = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=3, log_folder=tmp_path / "run", verbose=False,
                      callbacks=[callback])
    m = torch.nn.Linear(4, 1)
    dl = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    return Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), cfg).fit(dl)


def test_sys_exit_zero_in_a_worker_is_a_failure_not_an_untrained_model(tmp_path):
    with pytest.raises(WorkerError, match=r"sys.exit\(0\) before its function returned") as exc:
        _fit(tmp_path, Callback(on="train_start", callback=_exit_zero))
    assert exc.value.rank in (0, 1)


def test_a_rank_that_vanishes_with_code_zero_is_named_as_the_cause(tmp_path):
    with pytest.raises(WorkerError, match="exited with code 0 before its function returned") as exc:
        _fit(tmp_path, Callback(on="train_epoch_start", callback=_os_exit_rank1))
    assert exc.value.rank == 1, str(exc.value)  # not rank 0's "Connection reset by peer"


_IGNORING_SIGINT = textwrap.dedent("""
    import signal, sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    from trainstack import Trainer, TrainConfig
    from trainstack.errors import WorkerError

    def slow_loss(model, batch):
        time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script started with & from another script
        cfg = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=1000, log_folder=sys.argv[1], verbose=False,
                          hang_timeout=0)
        dl = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
        m = torch.nn.Linear(4, 1)
        try:
            Trainer(m, torch.optim.SGD(m.parameters(), lr=0.01), cfg, loss_fn=slow_loss).fit(dl)
        except WorkerError as exc:
            print("WORKER-ERROR", exc.rank, "interrupted (SIGINT)" in str(exc), flush=True)
            sys.exit(3)
        print("RETURNED-NORMALLY", flush=True)
""")


def test_workers_interrupted_by_sigint_stop_with_a_checkpoint_never_as_success(tmp_path):
    # the launcher ignores SIGINT; a SIGINT sent to the workers alone is a Ctrl-C all the same: a graceful stop
    script = tmp_path / "ignoring.py"
    script.write_text(_IGNORING_SIGINT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.3)
            workers = _workers(proc.pid)
        time.sleep(3)  # training
        for pid in workers:
            os.kill(pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "RETURNED-NORMALLY" not in out, out[-3000:]
    assert "Interrupted at epoch" in out and "resume" in out, out[-3000:]
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt")), out[-3000:]

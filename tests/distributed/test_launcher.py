"""The launcher as a user meets it: no foreign pickle is ever loaded, nothing left in the temp folder, a script
without a main guard or a notebook that cannot fork gets a clear error instead of a silently wrong run."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainstack._runtime.spawn import _read_error

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


class _Evil:
    def __init__(self, canary: Path) -> None:
        self.canary = str(canary)

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_error_reports_are_read_as_text_never_unpickled(tmp_path):
    canary = tmp_path / "CANARY"
    planted = tmp_path / "error-0.txt"
    planted.write_bytes(pickle.dumps(_Evil(canary)))
    detail, _ = _read_error(str(planted), 0.0)
    assert detail and not canary.exists()


_FAILING = textwrap.dedent("""
    import sys
    from trainstack import Accelerator
    from trainstack.errors import WorkerError

    def work(acc):
        if acc.rank == 1:
            raise ValueError("rank one fails on purpose")
        return acc.rank

    if __name__ == "__main__":
        acc = Accelerator(nprocs=2, compute_setup="cpu")
        try:
            acc.distribute(work)(acc)
        except WorkerError as exc:
            print("WORKER-ERROR", exc.rank, "rank one fails on purpose" in str(exc))
            if exc.rank != 1:
                print(exc.detail[-1500:])
            sys.exit(3)
""")


def test_a_failed_run_leaves_nothing_in_the_temp_folder(tmp_path, run_py):
    """torch writes per-worker error files into tempfile's folder and never deletes them; trainstack points them
    at its private 0700 launch folder, so another user cannot plant a pickle there and nothing is left behind."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anyone may create files here
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    proc = run_py([sys.executable, str(script)], env={"TMPDIR": str(shared)}, check=False, timeout=120)
    assert proc.returncode == 3 and "WORKER-ERROR 1 True" in proc.stdout, proc.stdout
    # (torch keeps its own compile cache, torchinductor_<user>, there: the preloaded torch._dynamo creates it)
    assert sorted(p.name for p in shared.iterdir() if not p.name.startswith("torchinductor_")) == [], proc.stdout


_NO_GUARD = textwrap.dedent("""
    from trainstack import Accelerator

    def work(acc):
        return acc.rank

    print("BODY RAN", flush=True)
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    print("RESULT", acc.distribute(work)(acc), flush=True)
""")


def test_a_script_without_main_guard_fails_with_the_fix_and_trains_once(tmp_path, run_py):
    script = tmp_path / "noguard.py"
    script.write_text(_NO_GUARD)
    proc = run_py([sys.executable, str(script)], check=False, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "main guard" in proc.stdout and 'if __name__ == "__main__":' in proc.stdout
    assert "RESULT 0" not in proc.stdout, proc.stdout  # never a silent second (or third) training run
    assert proc.stdout.count("Traceback") == 1 and "BrokenPipeError" not in proc.stdout  # one short error
    assert len(proc.stdout.splitlines()) < 30, proc.stdout


_TRAINER_NO_GUARD = textwrap.dedent("""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from trainstack import TrainConfig, Trainer

    model = torch.nn.Linear(2, 1)
    loader = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
            TrainConfig(nprocs=2, max_iter=1, compute_setup="cpu", verbose=False)).fit(loader)
    print("TRAINED", flush=True)
""")


def test_a_trainer_without_main_guard_gets_one_error_with_the_trainer_fix(tmp_path, run_py):
    script = tmp_path / "noguard_trainer.py"
    script.write_text(_TRAINER_NO_GUARD)
    proc = run_py([sys.executable, str(script)], check=False, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and re.search(r"noguard_trainer.py:\d+ starts the distributed run", proc.stdout)
    assert "Trainer(model, optimizer, config" in proc.stdout and "distribute(train)" not in proc.stdout
    assert proc.stdout.count("Traceback") == 1 and "TRAINED" not in proc.stdout and len(proc.stdout.splitlines()) < 30
    stdin = subprocess.run([sys.executable, "-"], input=_TRAINER_NO_GUARD, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)  # python - <<EOF: no file to re-import; workers fork
    assert stdin.returncode == 0 and "TRAINED" in stdin.stdout, stdin.stderr[-2000:]


_NOTEBOOK = textwrap.dedent("""
    import ctypes, threading, time
    from trainstack import Accelerator
    from trainstack.errors import LaunchError

    def autograd_like_thread():  # what a backward starts on a CUDA machine: a thread named pt_autograd_0
        ctypes.CDLL(None).prctl(15, b"pt_autograd_0", 0, 0, 0)
        time.sleep(60)

    threading.Thread(target=autograd_like_thread, daemon=True).start()
    time.sleep(0.2)
    acc = Accelerator(nprocs=2, compute_setup="cpu")
    try:
        acc.distribute(print)("never")
    except LaunchError as exc:
        print("LAUNCH-ERROR", exc)
""")


def test_notebook_after_a_backward_on_a_cuda_machine_explains_instead_of_forking(run_py):
    proc = run_py([sys.executable, "-c", _NOTEBOOK], timeout=60)  # -c: no __main__.__file__, like a notebook
    assert "LAUNCH-ERROR" in proc.stdout and "pt_autograd_0" in proc.stdout and "restart the kernel" in proc.stdout
    assert "never" not in proc.stdout.replace("call the distributed", "")


def test_bad_start_method_override_is_a_clear_error(run_py):
    code = ("from trainstack import Accelerator\n"
            "acc = Accelerator(nprocs=2, compute_setup='cpu')\n"
            "acc.distribute(print)('x')\n")
    proc = run_py([sys.executable, "-c", code], env={"TRAINSTACK_START_METHOD": "bogus"}, check=False, timeout=60)
    assert proc.returncode == 1 and "TRAINSTACK_START_METHOD='bogus'" in proc.stdout
    assert proc.stdout.count("Traceback") <= 1 and "spawn" in proc.stdout


_FIT = textwrap.dedent("""
    import sys, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from trainstack import Callback, TrainConfig, Trainer

    def slow(trainer, config, writer):
        print("epoch", trainer.current_epoch, flush=True)
        time.sleep(float(sys.argv[2]))

    if __name__ == "__main__":
        model = nn.Linear(3, 1)
        cfg = TrainConfig(nprocs=2, compute_setup="cpu", max_iter=3, log_folder=sys.argv[1], verbose=False,
                          checkpoint_every=1, callbacks=[Callback(on="train_epoch_end", callback=slow)])
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(
            DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4))
        print("DONE", flush=True)
""")


def test_leftovers_of_a_finished_and_a_killed_run(tmp_path, run_py):
    """A finished run leaves the temp folder as it found it; a SIGKILLed launcher can only leave its own private
    (0700) launch folder, and its workers die with it (as documented in the README)."""
    import signal as sig
    import subprocess
    import time

    from psutil_free import children_of

    shared = tmp_path / "tmp"
    shared.mkdir()
    script = tmp_path / "fit.py"
    script.write_text(_FIT)
    env = {**os.environ, "TMPDIR": str(shared), "PYTHONUNBUFFERED": "1"}
    ok = run_py([sys.executable, str(script), str(tmp_path / "ok"), "0"], env={"TMPDIR": str(shared)}, timeout=120)
    ours = lambda: [p.name for p in shared.iterdir() if not p.name.startswith("torchinductor_")]  # noqa: E731
    assert "DONE" in ok.stdout and ours() == []  # (torch keeps its own compile cache, torchinductor_<user>, there)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path / "killed"), "30"], env=env,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stdout.readline().startswith("epoch")
        workers = children_of(launcher.pid)
        launcher.send_signal(sig.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]
                  for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(launcher.pid, sig.SIGKILL) if launcher.poll() is None else None
    left = ours()
    assert all(name.startswith("trainstack-") for name in left) and len(left) <= 1, left
    assert all(oct((shared / n).stat().st_mode)[-3:] == "700" for n in left)


_CONFIG_IN_WORKER = textwrap.dedent("""
    from trainstack import Accelerator
    from trainstack.errors import ConfigError, TrainingDiverged, WorkerError

    def work(acc, kind):
        if acc.rank == 1:
            raise ConfigError("bad setting on purpose. HINT: change it") if kind == "config" else \\
                TrainingDiverged("the loss is nan on purpose")
        return acc.rank

    if __name__ == "__main__":
        acc = Accelerator(nprocs=2, compute_setup="cpu")
        for kind, cls in (("config", ConfigError), ("diverged", TrainingDiverged)):
            try:
                acc.distribute(work)(acc, kind)
            except cls as exc:  # the class a one-process run raises
                first = str(exc).splitlines()[0]
                print("CAUGHT", kind, isinstance(exc, WorkerError), exc.rank, repr(first),
                      "Traceback" in exc.detail, "Traceback" in str(exc))
""")


def test_a_config_error_in_a_worker_is_raised_as_itself(tmp_path, run_py):
    """`except ConfigError` works the same on 1 and N processes: the launching process raises the worker's
    ConfigError (or TrainingDiverged) as that class -- and as a WorkerError with the rank -- its message first and
    the worker's traceback kept in .detail, not printed twice."""
    script = tmp_path / "config_in_worker.py"
    script.write_text(_CONFIG_IN_WORKER)
    out = run_py([sys.executable, str(script)], timeout=150).stdout
    assert "CAUGHT config True 1 'bad setting on purpose. HINT: change it' True False" in out, out
    assert "CAUGHT diverged True 1 'the loss is nan on purpose' True False" in out, out


def test_a_carried_error_is_read_only_from_a_well_formed_header_and_pickles():
    """The header is data (JSON, a closed set of classes); anything else stays a plain WorkerError."""
    from trainstack._runtime.carried import carried_header, worker_error
    from trainstack.errors import ConfigError, LaunchError, WorkerError

    detail = carried_header(ConfigError("bad setting")) + "Traceback ...\nConfigError: bad setting"
    err = worker_error(3, detail, 1)
    assert isinstance(err, ConfigError) and isinstance(err, WorkerError) and err.rank == 3
    assert str(err).startswith("bad setting") and err.detail.startswith("Traceback")
    again = pickle.loads(pickle.dumps(err))  # e.g. through a joblib/Ray worker of the user's
    assert type(again) is type(err) and again.rank == 3 and str(again) == str(err)
    assert carried_header(LaunchError("x")) == ""
    for forged in ('trainstack-error: {"type": "LaunchError", "message": "x"}\nrest',
                   "trainstack-error: not json\nrest", "plain traceback"):
        plain = worker_error(0, forged)
        assert type(plain) is WorkerError and "worker rank 0 failed" in str(plain), forged


@pytest.mark.timeout(120)
def test_a_second_fit_in_the_same_torchrun_worker_gets_a_group_of_its_own(run_py, tmp_path):
    """Two fit() calls in one torchrun worker (train, then fine-tune): the second process group must not meet the
    first one's keys in torchrun's agent store (it hung: one rank joined the old group, the other waited)."""
    from helpers import torchrun_exe

    script = tmp_path / "two_fits.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch
        from trainstack import TrainConfig, Trainer
        for i in range(2):
            x = torch.randn(32, 4)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=8)
            model = torch.nn.Linear(4, 4)
            Trainer(model, torch.optim.SGD(model.parameters(), 0.1),
                    TrainConfig(max_iter=1, log_folder=f"{sys.argv[1]}/fit{i}", verbose=False)).fit(loader)
            print(f"fit {i} done on rank {os.environ['RANK']}", flush=True)
    """))
    proc = run_py([torchrun_exe(), "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)], timeout=90)
    assert all(f"fit 1 done on rank {r}" in proc.stdout for r in (0, 1)), proc.stdout[-3000:]

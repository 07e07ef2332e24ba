"""The run folder: where a run writes, the lock that keeps two runs apart, and no silent overwrite."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainstack._train.runfolder import RunFolderBusy, RunLock, choose_run_folder, refuse_to_overwrite
from trainstack.errors import ConfigError


def _with_checkpoint(folder: Path) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "ckpt-e00001-s000000001.pt").write_bytes(b"x")
    return folder


def test_choice_rules(tmp_path):
    root = tmp_path / "root"
    assert choose_run_folder(root, tmp_path / "mine", False, None, {}) == tmp_path / "mine"
    assert choose_run_folder(root, Path("./"), False, None, {"SLURM_JOB_ID": "42"}) == root / "slurm-42"
    assert choose_run_folder(root, Path("./"), False, None, {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40",
                                                             "SLURM_ARRAY_TASK_ID": "3"}) == root / "slurm-40_3"
    fresh = choose_run_folder(root, Path("./"), True, None, {"SLURM_JOB_ID": "42"})
    assert fresh.parent == root and fresh.name != "slurm-42"  # create_subfolder_per_run: always new


def test_resume_auto_picks_the_newest_folder_with_a_checkpoint_that_is_not_in_use(tmp_path):
    root = tmp_path / "root"
    old = _with_checkpoint(root / "a")
    time.sleep(0.01)
    newest = _with_checkpoint(root / "b")
    (root / "c").mkdir()  # no checkpoint
    assert choose_run_folder(root, Path("./"), False, "auto", {}) == newest
    lock = RunLock(newest)
    lock.acquire()
    try:
        assert choose_run_folder(root, Path("./"), False, "auto", {}) == old  # b is live: never resumed twice
    finally:
        lock.release()


def test_a_second_process_cannot_take_a_locked_folder(tmp_path):
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    code = ("import sys; from pathlib import Path; from trainstack._train.runfolder import RunLock, RunFolderBusy\n"
            "try:\n    RunLock(Path(sys.argv[1])).acquire()\nexcept RunFolderBusy as e:\n    print(e); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3 and "is in use by another run" in proc.stdout and '"pid"' in proc.stdout
    assert RunLock.held(tmp_path / "run")
    lock.release()
    assert not RunLock.held(tmp_path / "run")
    again = RunLock(tmp_path / "run")
    again.acquire()
    again.release()


def test_a_killed_holder_leaves_the_folder_free(tmp_path):
    code = "import sys, time; from pathlib import Path; from trainstack._train.runfolder import RunLock\n" \
           "lock = RunLock(Path(sys.argv[1])); lock.acquire(); print('held', flush=True); time.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert RunLock.held(tmp_path / "run")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert not RunLock.held(tmp_path / "run")


def test_a_fresh_run_never_overwrites_earlier_checkpoints(tmp_path):
    folder = _with_checkpoint(tmp_path / "run")
    with pytest.raises(ConfigError, match="resume='auto'"):
        refuse_to_overwrite(folder, None)
    refuse_to_overwrite(folder, "auto")
    refuse_to_overwrite(tmp_path / "empty", None)
    assert issubclass(RunFolderBusy, ConfigError)


def test_a_sweep_task_trains_in_the_folder_its_job_names(tmp_path):
    root, task = tmp_path / "root", tmp_path / "sweep-x" / "abc123"
    env = {"TRAINSTACK_RUN_DIR": str(task), "SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1"}
    assert choose_run_folder(root, Path("./"), False, None, env) == task  # before the slurm-<id> rule
    assert choose_run_folder(root, tmp_path / "mine", False, None, env) == task  # a script's log_folder: shared
    assert choose_run_folder(root, Path("./"), True, None, env).parent == task  # a new folder inside it


def _as_nobody(*args: str) -> None:
    """Run a command as the unprivileged user ``nobody`` (the attacker sharing a group-writable folder)."""
    import os
    import shutil

    if os.getuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to act as a second user")
    subprocess.run(["runuser", "-u", "nobody", "--", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def shared_folder():
    """A folder another local user can reach (pytest's own temp root is private to us)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="trainstack-shared-", dir="/tmp"))
    folder.chmod(0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_links_planted_by_another_user_in_a_shared_run_folder_are_never_followed(shared_folder):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainstack import TrainConfig, Trainer
    from trainstack._common.files import UntrustedFileError

    tmp_path = shared_folder
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)  # group- and world-writable: anyone may create entries
    victim, victim2 = tmp_path / "victim.txt", tmp_path / "victim2.txt"
    victim.write_text("precious\n")
    victim2.write_text("precious too\n")
    _as_nobody("ln", "-s", str(victim), str(run / ".lock"))
    _as_nobody("ln", "-s", str(victim2), str(run / "metrics.jsonl"))

    def fit():
        m = torch.nn.Linear(2, 1)
        dl = DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)
        Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), TrainConfig(max_iter=1, log_folder=run,
                                                                          verbose=False)).fit(dl)

    with pytest.raises(ConfigError, match="symbolic link"):
        fit()
    (run / ".lock").unlink()
    with pytest.raises(UntrustedFileError, match="symbolic link"):
        fit()
    assert victim.read_text() == "precious\n" and victim2.read_text() == "precious too\n"


def test_a_read_only_folder_is_a_clear_error(tmp_path):
    import os

    if os.getuid() == 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(ro)], check=False)
        try:
            with pytest.raises(ConfigError, match="cannot use the run folder .*HINT: set TrainConfig"):
                RunLock(ro / "run").acquire()
        finally:
            subprocess.run(["umount", "-l", str(ro)], check=False)
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot use the run folder"):
            RunLock(ro / "run").acquire()


def _fit(folder_kw: dict, seed: int = 0, lr: float = 0.1, max_iter: int = 2):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainstack import TrainConfig, Trainer

    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    dl = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4)
    trainer = Trainer(m, torch.optim.SGD(m.parameters(), lr=lr), TrainConfig(
        max_iter=max_iter, verbose=False, seed=seed, checkpoint_every=1, resume="auto", **folder_kw))
    trainer.fit(dl)
    return trainer


def test_resume_auto_never_continues_another_experiment(tmp_path, capsys):
    first = _fit({"root_folder": tmp_path}, seed=1, lr=0.1)
    other = _fit({"root_folder": tmp_path}, seed=2, lr=0.01)  # another experiment on the same root
    assert other.run_folder != first.run_folder and other.current_epoch == 2
    assert "another experiment ran there (seed: 1 -> 2; param group 0 lr: 0.1 -> 0.01)" in capsys.readouterr().out
    again = _fit({"root_folder": tmp_path}, seed=2, lr=0.01, max_iter=3)  # the same experiment: continues
    assert again.run_folder == other.run_folder and again.current_epoch == 3


def test_a_resume_of_another_experiment_is_refused_naming_both_values(tmp_path):
    """An explicit log_folder (a script's, or after a copy) holding a checkpoint of another seed or learning rate:
    continuing it would train the wrong experiment under this one's name."""
    from trainstack.errors import ConfigError

    _fit({"log_folder": tmp_path / "run"}, seed=0, lr=0.1)
    with pytest.raises(ConfigError) as info:
        _fit({"log_folder": tmp_path / "run"}, seed=1, lr=0.01, max_iter=3)
    message = str(info.value)
    assert "written by another experiment: seed: 0 -> 1; param group 0 lr: 0.1 -> 0.01" in message, message
    assert _fit({"log_folder": tmp_path / "run"}, seed=0, lr=0.1, max_iter=3).current_epoch == 3  # the same one


def test_resume_auto_on_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys):
    from trainstack import TrainConfig

    _fit({"log_folder": tmp_path / "run"})
    recorded = next((tmp_path / "run").glob("config.*")).read_text()
    capsys.readouterr()
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainstack import Trainer

    m = torch.nn.Linear(2, 1)
    cfg = TrainConfig(max_iter=2, log_folder=tmp_path / "run", resume="auto", seed=0)
    Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), cfg).fit(
        DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4))
    out = capsys.readouterr().out
    assert "NOTHING TO TRAIN" in out and "raise max_iter" in out
    assert "Total optimization steps" in out and "= -" not in out
    assert next((tmp_path / "run").glob("config.*")).read_text() == recorded  # what trained, not the no-op's


def test_concurrent_auto_resumes_skip_a_folder_claimed_meanwhile(tmp_path):
    """Two runs claim with resume='auto' at the same instant: the loser takes the next folder, never an error."""
    import threading

    from trainstack._train.runfolder import RunLock

    _fit({"root_folder": tmp_path}, max_iter=1)
    newest = max(tmp_path.iterdir(), key=lambda p: p.stat().st_mtime)
    holder = RunLock(newest)
    started = threading.Event()

    def claim_late():  # the folder gets claimed between the choice and the lock
        started.set()
        holder.acquire()

    original = RunLock.acquire

    def racing_acquire(self):
        if self.folder == newest and not started.is_set():
            claim_late()
        return original(self)

    RunLock.acquire = racing_acquire
    try:
        trainer = _fit({"root_folder": tmp_path}, max_iter=1)
    finally:
        RunLock.acquire = original
        holder.release()
    assert trainer.run_folder != newest

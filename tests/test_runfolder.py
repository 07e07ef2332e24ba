"""The run folder: where a run writes, the lock that keeps two runs apart, and no silent overwrite."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainstack._runfolder import RunFolderBusy, RunLock, choose_run_folder, refuse_to_overwrite
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
    code = ("import sys; from pathlib import Path; from trainstack._runfolder import RunLock, RunFolderBusy\n"
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
    code = "import sys, time; from pathlib import Path; from trainstack._runfolder import RunLock\n" \
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
    assert choose_run_folder(root, tmp_path / "mine", False, None, env) == tmp_path / "mine"  # explicit wins
    assert choose_run_folder(root, Path("./"), True, None, env).parent == task  # a new folder inside it

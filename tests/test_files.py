"""Private folders and the only pickle loader: a file another user could have written is never unpickled."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys

import pytest

from trainstack._common.files import UntrustedFileError, atomic_write, check_private, load_private_pickle, private_dir

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


class _Evil:
    def __init__(self, canary):
        self.canary = str(canary)

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_atomic_write_sets_the_mode_and_leaves_no_temp_file(tmp_path):
    path = atomic_write(tmp_path / "a.bin", b"x", mode=0o600)
    assert path.read_bytes() == b"x" and stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write(path, "y", mode=0o644)
    assert path.read_text() == "y" and sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_private_dir_is_0700(tmp_path):
    folder = private_dir(tmp_path / "logs", prefix="job-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.parent == tmp_path / "logs"


def test_own_private_pickle_loads(tmp_path):
    folder = private_dir(tmp_path, prefix="p-")
    atomic_write(folder / "ok.pkl", pickle.dumps({"a": 1}), mode=0o600)
    assert load_private_pickle(folder / "ok.pkl") == {"a": 1}


@as_root
def test_a_pickle_owned_by_another_user_is_refused(tmp_path):
    folder = private_dir(tmp_path, prefix="p-")
    canary = tmp_path / "CANARY"
    evil = atomic_write(folder / "result.pkl", pickle.dumps(_Evil(canary)), mode=0o600)
    os.chown(evil, NOBODY, NOBODY)
    with pytest.raises(UntrustedFileError, match="owned by uid 65534"):
        load_private_pickle(evil)
    assert not canary.exists()


def test_a_pickle_in_a_shared_folder_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    canary = tmp_path / "CANARY"
    evil = atomic_write(shared / "call.pkl", pickle.dumps(_Evil(canary)), mode=0o600)
    with pytest.raises(UntrustedFileError, match="writable by other users"):
        load_private_pickle(evil)
    assert not canary.exists()


def test_a_symlinked_pickle_is_refused(tmp_path):
    folder = private_dir(tmp_path, prefix="p-")
    target = atomic_write(tmp_path / "elsewhere.pkl", pickle.dumps(1), mode=0o600)
    (folder / "call.pkl").symlink_to(target)
    with pytest.raises(UntrustedFileError, match="symbolic link"):
        check_private(folder / "call.pkl")


@as_root
def test_remote_refuses_a_planted_call(tmp_path):
    folder = private_dir(tmp_path, prefix="p-")
    canary = tmp_path / "CANARY"
    call = atomic_write(folder / "call.pkl", pickle.dumps(_Evil(canary)), mode=0o600)
    os.chown(call, NOBODY, NOBODY)
    proc = subprocess.run([sys.executable, "-m", "trainstack._remote", str(call)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "refusing to load" in proc.stderr and "Traceback" not in proc.stderr
    assert not canary.exists() and not (folder / "result.pkl").exists()


def test_nothing_under_a_folder_is_left_writable_by_others(tmp_path):
    from trainstack._common.files import deny_others_write

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "a" / "link").symlink_to("/etc/passwd")
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "f"):
        p.chmod(0o777 if p.is_dir() else 0o666)
    deny_others_write(tmp_path / "a")
    assert all(not p.lstat().st_mode & 0o022 for p in (tmp_path / "a").rglob("*") if not p.is_symlink())
    single = tmp_path / "one"
    single.write_text("x")
    single.chmod(0o666)
    deny_others_write(single)
    assert stat.S_IMODE(single.stat().st_mode) == 0o644


@as_root
def test_stage_into_a_folder_it_cannot_use_is_a_clear_error(tmp_path):
    """Probe 5 B25: a PermissionError traceback; here a folder of another user's."""
    from click.testing import CliRunner

    from trainstack.cli import main

    foreign = tmp_path / "scratch"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)
    from trainstack._checkpoint.store import Store

    local = tmp_path / "ckpt-e00000-s000000004.pt"
    local.write_bytes(b"weights")
    Store(f"file://{tmp_path / 'store'}").upload(local)
    result = CliRunner().invoke(main, ["checkpoint", "stage", f"file://{tmp_path / 'store'}", str(foreign)])
    assert result.exit_code == 1 and "cannot stage into" in result.output and "belongs to uid 65534" in \
        result.output and result.exception is None or isinstance(result.exception, SystemExit), result.output


def test_a_run_folders_metrics_written_under_umask_002_are_still_read(tmp_path):
    """The bounded reader's owner check is for job folders: a run folder's metrics.jsonl that an older version
    wrote group-writable (umask 002) is read, never dropped on resume."""
    from trainstack._runtime.writers import JsonlWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
    path.chmod(0o664)
    writer = JsonlWriter(tmp_path)
    assert [r["step"] for r in writer.rows()] == [1, 2]
    writer.close()

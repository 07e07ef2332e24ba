"""The code snapshot taken on submit: what is copied, what is linked, what is reported, on a real git repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainstack._common.version import source_commit, source_digest
from trainstack._slurm.snapshot import MAX_FILE_BYTES, SnapshotError, git_root, git_state, ship_driver, take

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "train.py").write_text("print('v1')\n")
    (repo / ".gitignore").write_text("data/\nlogs/\n*.bin\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    return repo


def test_snapshot_holds_the_working_tree_and_links_what_git_ignores(tmp_path):
    repo = _repo(tmp_path)
    (repo / "train.py").write_text("print('v2, uncommitted')\n")
    (repo / "new_module.py").write_text("X = 1\n")  # untracked, not ignored: part of the job
    (repo / "data").mkdir()
    (repo / "data" / "x.txt").write_text("data")
    (repo / "logs").mkdir()
    (repo / "weights.bin").write_bytes(b"0" * 10)
    snap = take(repo, tmp_path / "code", exclude=[repo / "logs"])
    code = tmp_path / "code"
    assert (code / "train.py").read_text() == "print('v2, uncommitted')\n"
    assert (code / "new_module.py").exists() and (code / "pkg" / "__init__.py").exists()
    assert snap.changed == ["train.py"] and snap.untracked == ["new_module.py"] and snap.dirty
    assert len(snap.commit or "") == 40 and snap.files == 4 and snap.bytes > 0
    for name in ("data", "logs", "weights.bin"):  # ignored or excluded: linked to the original, not copied
        assert (code / name).is_symlink() and os.readlink(code / name) == str((repo / name).resolve())
    assert (code / "data" / "x.txt").read_text() == "data" and sorted(snap.linked) == ["data", "logs", "weights.bin"]
    assert not (code / ".git").exists()
    (repo / "train.py").write_text("print('v3')\n")  # later edits do not reach the copy
    assert (code / "train.py").read_text() == "print('v2, uncommitted')\n"


def test_snapshot_from_a_subfolder_and_large_files_left_out(tmp_path):
    repo = _repo(tmp_path)
    big = repo / "pkg" / "big.dat"
    with open(big, "wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)
    snap = take(repo / "pkg", tmp_path / "code", exclude=[])
    assert snap.relative_cwd == "pkg" and snap.skipped == ["pkg/big.dat"]
    assert (tmp_path / "code" / "train.py").exists() and (tmp_path / "code" / "pkg" / "big.dat").is_symlink()
    assert git_root(repo / "pkg") == repo.resolve() and git_state(repo)[2] == ["pkg/big.dat"]


def test_outside_a_repository_there_is_nothing_to_snapshot(tmp_path):
    assert git_root(tmp_path) is None
    with pytest.raises(ValueError, match="not inside a git repository"):
        take(tmp_path, tmp_path / "code", exclude=[])


def test_submodule_files_are_copied(tmp_path):
    lib = tmp_path / "libsrc"
    lib.mkdir()
    subprocess.run(["git", "init", "-q", str(lib)], check=True)
    (lib / "libmod.py").write_text("VALUE = 42\n")
    for cmd in (["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "lib"]):
        subprocess.run(["git", "-C", str(lib), *cmd], check=True)
    repo = _repo(tmp_path)
    subprocess.run(["git", "-C", str(repo), "-c", "protocol.file.allow=always", "submodule", "add", "-q",
                    str(lib), "vendor/lib"], check=True, capture_output=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "sub"],
                   check=True)
    take(repo, tmp_path / "code", exclude=[])
    assert (tmp_path / "code" / "vendor" / "lib" / "libmod.py").read_text() == "VALUE = 42\n"


def test_an_unreadable_file_stops_the_snapshot_with_its_name(tmp_path):
    if os.getuid() == 0:
        pytest.skip("root reads every file (tests/slurm/test_workflow.py checks it as a second user)")
    repo = _repo(tmp_path)
    (repo / "train.py").chmod(0)
    with pytest.raises(SnapshotError, match="train.py.*HINT"):
        take(repo, tmp_path / "code", exclude=[])


def test_the_shipped_driver_is_the_code_the_plan_pins(tmp_path):
    """The copy submit ships in a job folder has the package's digest (a driver run from it says nothing), is not a
    git checkout (no commit claimed for it), and one changed file changes the digest."""
    copy = ship_driver(tmp_path / "driver")
    assert source_digest(copy) == source_digest() and source_commit(copy) == ""
    (copy / "_slurm" / "plan.py").write_text((copy / "_slurm" / "plan.py").read_text() + "\n")
    source_digest.cache_clear()
    assert source_digest(copy) != source_digest()

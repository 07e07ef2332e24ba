"""The job folder as untrusted input (reliability probe 5, defects 1-3, 8, 12): only the owner's records are read,
through one bounded reader that never follows a link or blocks on a FIFO; nothing is written through a planted link
or left writable by others; an offer sets only the rendezvous and counters; a memory listing deletes nothing but
this user's memory folders of this job. Another user is played by chown to nobody (the tests run as root in CI)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainstack._common.files import UnreadableFile, read_back
from trainstack._common.jobfiles import EXIT_RECORD_SH, FREE_MEMORY_SH, JobFiles, Offer, StopRequest

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
GOOD = {"step": 1, "env": {"MASTER_ADDR": "node1", "MASTER_PORT": "61234", "TRAINSTACK_STEP": "1",
                           "TRAINSTACK_ATTEMPT": "1", "TRAINSTACK_NPROCS": "2"}, "ranks": [0], "per_node": 1}


@pytest.fixture
def files(tmp_path):
    old = os.umask(0o002)  # a group project space: what the probe's victim ran under
    try:
        job = JobFiles.mine(tmp_path / "job-1")
        job.make_own()
        yield job
    finally:
        os.umask(old)


def _offer(files: JobFiles, name: str, body: object) -> Path:
    folder = files.path(JobFiles.REJOIN)
    folder.mkdir(exist_ok=True, mode=0o755)
    path = folder / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    path.chmod(0o644)
    return path


def test_the_drivers_offer_is_read_back_typed(files):
    files.step.offer(1, {**GOOD["env"], "PATH": "/x", "LD_PRELOAD": "/evil.so"}, [0], 1)
    offer = files.step.offer_after(0)
    assert offer == Offer(1, GOOD["env"], (0,), 1) and offer.where == "node1:61234"  # only OFFERED names written


@pytest.mark.parametrize("body, why", [
    ({**GOOD, "env": {**GOOD["env"], "LD_PRELOAD": "/tmp/evil.so"}}, "LD_PRELOAD, which an offer never sets"),
    ({**GOOD, "env": {**GOOD["env"], "TRAINSTACK_CHECKPOINT_STORE": "file:///x"}}, "never sets"),
    ("{{{", "is not JSON"), (5, "not a JSON object"), ([1, 2], "not a JSON object"), (None, "not a JSON object"),
    ({**GOOD, "ranks": 1}, "'ranks' must be"), ({**GOOD, "ranks": ["1"]}, "'ranks' must be"),
    ({**GOOD, "step": "x"}, "names step 'x'"), ({k: v for k, v in GOOD.items() if k != "step"}, "names step None"),
    ({**GOOD, "per_node": "x"}, "'per_node'"), ({**GOOD, "per_node": -3}, "'per_node'"),
    ({**GOOD, "per_node": 0}, "'per_node'"), ({**GOOD, "env": "abc"}, "'env' must be an object"),
    ({**GOOD, "env": [["A", "B"]]}, "'env' must be an object"),
    ({**GOOD, "env": {**GOOD["env"], "MASTER_ADDR": "a\0b"}}, "MASTER_ADDR"),
    ({**GOOD, "env": {**GOOD["env"], "MASTER_PORT": "1e3"}}, "must be a number"),
    ({**GOOD, "env": {**GOOD["env"], "MASTER_PORT": "70000"}}, "is not a port"),
    ({**GOOD, "step": 3}, "not the step 1 of its name"),
])
def test_a_malformed_or_overreaching_offer_is_passed_over_and_named(files, capsys, body, why):
    """Probe A2, A6-A13, A16: nothing of it reaches the survivor's environment; no TypeError/KeyError."""
    path = _offer(files, "step-1.json", body)
    assert files.step.offer_after(0) is None
    err = capsys.readouterr().err
    assert f"passing over an offer: {path}" in err and why in err, err


def test_a_forged_higher_offer_does_not_shadow_the_drivers(files, capsys):
    """Probe A6: an unreadable step-99.json is named and the driver's own step-1 offer is still taken."""
    files.step.offer(1, GOOD["env"], [0], 1)
    _offer(files, "step-99.json", "{{{")
    offer = files.step.offer_after(0)
    assert offer is not None and offer.step == 1 and "step-99.json" in capsys.readouterr().err


@as_root
def test_an_offer_written_by_another_user_is_refused(files, capsys):
    """Probe A3: a group member's step-99.json with LD_PRELOAD (here even with only the right keys) is not taken."""
    path = _offer(files, "step-99.json", {**GOOD, "step": 99, "env": {**GOOD["env"], "TRAINSTACK_STEP": "99"}})
    os.chown(path, NOBODY, NOBODY)
    assert files.step.offer_after(0) is None
    assert "belongs to uid 65534" in capsys.readouterr().err


def test_an_offer_that_is_a_fifo_or_a_link_to_dev_zero_neither_blocks_nor_fills_memory(files, capsys):
    """Probe A18, A19: refused at once."""
    folder = files.path(JobFiles.REJOIN)
    folder.mkdir(mode=0o755)
    os.mkfifo(folder / "step-2.json", 0o644)
    (folder / "step-3.json").symlink_to("/dev/zero")
    started = time.monotonic()
    assert files.step.offer_after(0) is None and time.monotonic() - started < 2
    err = capsys.readouterr().err
    assert "not a regular file" in err and "symbolic link" in err, err


def test_a_large_offer_is_refused_without_reading_it_whole(files, capsys):
    """Probe A20: a bounded read."""
    _offer(files, "step-1.json", json.dumps({**GOOD, "pad": "x" * (2 << 20)}))
    assert files.step.offer_after(0) is None and "more than the" in capsys.readouterr().err


@as_root
def test_a_rejoin_folder_of_another_user_is_refused_with_a_line(files):
    """Probe A5: the driver gets an error that names the folder, not a raw PermissionError from a temp file."""
    folder = files.path(JobFiles.REJOIN)
    folder.mkdir(mode=0o755)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="belongs to uid 65534, not to you"):
        files.step.offer(1, GOOD["env"], [0], 1)


def test_records_are_never_written_through_a_planted_link(files, tmp_path):
    """Probe A28, E2c: a link planted where a rank writes peers-lost/rank-0, steps/, the memory listing, the lost
    nodes or the stop answer leaves its target as it was."""
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    for sub in (JobFiles.PEERS_LOST, JobFiles.STEPS):
        files.path(sub).mkdir(mode=0o755)
    links = [files.path(JobFiles.PEERS_LOST) / "rank-0", files.path(JobFiles.STEPS) / "node1-42",
             files.path(JobFiles.MEMORY_FOLDERS), files.path(JobFiles.LOST), files.path(JobFiles.PROGRESS)]
    for link in links:
        link.symlink_to(victim)
    files.step.peer_lost(0, "node1", 3, waiting=True)
    files.step.note_step("node1", 42, 1)
    files.step.write_lost({"node2": [1]})
    files.write_progress(5)
    with pytest.raises(PermissionError):
        files.memory.record(Path("/dev/shm/trainstack-0/job-1-abc"))
    assert victim.read_text() == "precious\n"
    assert files.step.waiting(3) == {0: "node1"}  # the rank's record replaced the link


def test_nothing_written_in_a_job_folder_is_writable_by_others_under_umask_002(files):
    """Done-when of issue 64: every record, subfolder and the exit record of the task wrapper."""
    files.mark_started()
    files.step.peer_lost(1, "node1", 0)
    files.step.offer(1, GOOD["env"], [0], 1)
    files.step.joined(0, 1)
    files.step.note_step("node1", 7, 1)
    files.record_event("x")
    files.append_verdict({"attempt": 0})
    files.memory.record(Path("/dev/shm/trainstack-0/job-1-abc"))
    files.write_exit_code(0)
    files.stop.request()
    files.driver.beat()
    StopRequest.confirm_saved(str(files.stop.file), None)
    files.own_ledger_dir()
    env = {**os.environ, "TRAINSTACK_JOB_DIR": str(files.folder), "SLURM_PROCID": "0", "TRAINSTACK_STEP": "0"}
    done = subprocess.run(["bash", "-c", "umask 002; exec bash -c \"$0\" trainstack-task rank false",
                           EXIT_RECORD_SH], env=env, timeout=30)
    assert done.returncode == 1 and [x.rank for x in files.step.exits(0)] == [0]
    open_to_others = [str(p) for p in [files.folder, *files.folder.rglob("*")]
                      if not p.is_symlink() and p.lstat().st_mode & 0o022]
    assert not open_to_others and (files.folder / "rank-0.out").exists()


@as_root
def test_a_forged_exit_record_of_another_user_is_not_believed(files, capsys):
    """Probe E32: a hand-written exits/rank-1 made the driver kill a healthy step and spend a retry."""
    folder = files.path(JobFiles.EXITS)
    folder.mkdir(mode=0o755)
    forged = folder / "rank-1"
    forged.write_text(f"{time.time()} 137 rank-1 node2 0\n")
    os.chown(forged, NOBODY, NOBODY)
    assert files.step.exits(0) == [] and not files.step.has_exits(0)
    assert "belongs to uid 65534" in capsys.readouterr().err


@as_root
def test_flags_planted_by_another_user_are_not_flags(files):
    """A stop request, a cancel, a driver's end: only the owner's count (a forged .stop would stop the run)."""
    for name in (JobFiles.STOP, JobFiles.CANCELLED, JobFiles.DRIVER_END):
        files.path(name).write_text("")
        os.chown(files.path(name), NOBODY, NOBODY)
    assert not StopRequest.requested(files.stop.file) and not files.cancelled()


def test_a_fifo_timeline_does_not_hang_its_readers(files):
    """Probe E28: status, why, --attempts read events.jsonl, verdicts.jsonl through the bounded reader."""
    os.mkfifo(files.events_file)
    os.mkfifo(files.path(JobFiles.VERDICTS))
    started = time.monotonic()
    assert files.events() == [] and files.verdicts() == [] and time.monotonic() - started < 2


def test_a_long_timeline_is_read_from_its_newest_end(files, monkeypatch):
    import trainstack._common.files as module

    monkeypatch.setattr(module, "LARGE", 4096)
    for i in range(500):
        files.record_event("tick", i=i)
    events = files.events()
    assert events[-1]["i"] == 499 and 0 < len(events) < 500  # bounded, newest kept, no torn first line


def test_a_teammates_job_folder_is_read_as_theirs(tmp_path):
    """status of another user's job reads their records (owner None: the folder's owner); the driver trusts only
    its own user's (``JobFiles.mine``)."""
    job = JobFiles(tmp_path)
    job.append_verdict({"attempt": 0, "kind": "x"})
    assert job.uid == os.getuid() and job.verdicts() == [{"attempt": 0, "kind": "x"}]


@pytest.fixture
def memory_root(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    root = base / f"trainstack-{os.getuid()}"
    for name in ("job-8-aaaa", "job-8-bbbb", "job-9-cccc"):
        (root / name / "node1").mkdir(parents=True)
    monkeypatch.setenv("TRAINSTACK_MEMORY_DIR", str(base))
    return root


def _free(job: str, roots: list[str]) -> None:
    subprocess.run(["bash", "-c", FREE_MEMORY_SH, "_", job, *roots], check=True, timeout=30)


@pytest.mark.parametrize("line", ["{root}/job-8-aaaa/../../../victim", "{tmp}/x/trainstack-{uid}/job-8-x/../../victim",
                                  "{root}/../../victim/trainstack-{uid}/job-8-x", "{root}/job-8-link/"])
def test_a_memory_listing_line_deletes_nothing_but_this_jobs_memory_folders(tmp_path, memory_root, files, line,
                                                                             capsys):
    """Probe E1, E2, E2b: `..` lines, a root outside the user's, a trailing slash on a link -- the victim folder
    stays; only job 8's own folders in this user's root go."""
    victim = tmp_path / "victim"
    (victim / f"trainstack-{os.getuid()}").mkdir(parents=True)
    (victim / "precious").write_text("x")
    (memory_root / "job-8-link").symlink_to(victim)
    listing = line.format(root=memory_root, tmp=tmp_path, uid=os.getuid())
    files.path(JobFiles.MEMORY_FOLDERS).write_text(f"{memory_root}/job-8-aaaa\n{listing}\n")
    files.path(JobFiles.MEMORY_FOLDERS).chmod(0o644)
    roots = files.memory.roots()
    assert roots == [str(memory_root)] or roots == [str(memory_root), listing.rsplit("/", 1)[0]]
    _free("8", roots)
    assert (victim / "precious").exists() and (victim / f"trainstack-{os.getuid()}").is_dir()
    assert sorted(p.name for p in memory_root.iterdir()) == ["job-8-link", "job-9-cccc"]  # a link is not followed


def test_the_reader_refuses_what_it_must(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100)
    with pytest.raises(UnreadableFile, match="more than the 10"):
        read_back(tmp_path / "big", 10)
    assert read_back(tmp_path / "big", 10, tail=True) == b""  # one long line cut: no torn line returned
    (tmp_path / "open").write_text("x")
    (tmp_path / "open").chmod(0o666)
    with pytest.raises(UnreadableFile, match="writable by other users"):
        read_back(tmp_path / "open")
    assert read_back(tmp_path / "open", owner=None) == b"x"  # a log: anyone's
    with pytest.raises(FileNotFoundError):
        read_back(tmp_path / "missing")


def test_a_survivor_that_cannot_join_leaves_saying_where(tmp_path):
    """Probe A25: a rendezvous nobody serves (a wrong port) -- bounded, and the line names the step and host:port."""
    code = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from trainstack._runtime import inplace
from trainstack._common.jobfiles import Offer
inplace.JOIN_S = 0.5
class Stuck:
    rank = 0
    restarts_in_place = True
    def rejoin(self, env):
        time.sleep(30)
inplace.join(Stuck(), Offer(3, {{"MASTER_ADDR": "node1", "MASTER_PORT": "1"}}, (0,), 1))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert done.returncode == 1 and "could not join job step 3 at node1:1 within 0.5 s" in done.stderr, done.stderr


def test_the_owner_check_covers_a_group_writable_subfolder(files, capsys):
    folder = files.path(JobFiles.PEERS_LOST)
    folder.mkdir()
    (folder / "rank-0").write_text("1.0 0 node1 waiting\n")
    (folder / "rank-0").chmod(0o644)
    folder.chmod(0o775)
    assert files.step.waiting(0) == {} and "only they can write" in capsys.readouterr().err
    files.step.peer_lost(1, "node1", 0, waiting=True)  # the writer takes the folder back
    assert not stat.S_IMODE(folder.stat().st_mode) & 0o022 and set(files.step.waiting(0)) == {0, 1}

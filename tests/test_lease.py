"""One writer per run (issue 55): the lease taken with a real S3-compatible server's conditional writes (moto's server
mode on 127.0.0.1) and with a lock on a local folder; a race of many takers gives each its own epoch; a writer that
lost the lease commits nothing; two training runs on one store (a split brain) end with one committed lineage; each
attempt says what it keeps from the one before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, ci_leaves_out

from trainstack._common import lease as _lease
from trainstack.errors import ConfigError

pytest.importorskip("s3fs")
pytestmark = [pytest.mark.timeout(300)]
SCRIPT = str(Path(__file__).with_name("_store_train.py"))


def _store(url: str):
    from trainstack._checkpoint.store import Store

    return Store(url)


@pytest.fixture(params=["s3", "local"])
def url(request, tmp_path):
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('bucket')}/runs/r1"
    return str(tmp_path / "store")


def test_a_second_attempt_takes_over_and_the_first_may_not_commit(url):
    a = _store(url).lease({"cluster": "alpha", "job": "11", "host": "a1"})
    assert a.take(None, {"gpu": "cpu"}) == 1
    a.check()
    b = _store(url).lease({"cluster": "beta", "job": "907", "host": "b3"})
    assert b.take(8) == 2
    b.check()
    with pytest.raises(_lease.StaleLease, match=r"held at epoch 2 by beta job 907 on b3, and this writer holds "
                                                r"epoch 1\. It stops without committing"):
        a.check()
    store = _store(url)
    epochs = _lease.history(store.fs, store.root)
    assert [(e["epoch"], e["cluster"], e["base_step"]) for e in epochs] == [(1, "alpha", None), (2, "beta", 8)]
    assert [r["epoch"] for r in _lease.attempts(store.fs, store.root)] == [1, 2]


def test_many_takers_at_once_each_get_their_own_epoch(url):
    """The conditional write is what makes this hold: a read-then-write without it hands one epoch out twice."""
    got: list[int] = []

    def take(i: int) -> None:
        got.append(_store(url).lease({"cluster": f"c{i}", "host": "h"}).take(None, tries=50))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    store = _store(url)
    assert [e["epoch"] for e in _lease.history(store.fs, store.root)] == [1, 2, 3, 4, 5, 6]


def test_a_store_without_conditional_writes_is_refused_for_a_lease(monkeypatch):
    from trainstack._train.runstore import take_lease

    store = _store("memory://ts-lease-test/run")
    with pytest.raises(ConfigError, match=r"knows no conditional write for memory://.*cannot keep one writer"):
        store.lease({"cluster": "x"})
    said: list[str] = []
    assert take_lease(store, 1, said.append) is None and "committed without a lease" in said[0]
    monkeypatch.setenv("TRAINSTACK_LEASE", "required")
    with pytest.raises(ConfigError, match="memory://"):
        take_lease(store, 1, said.append)


def _marker(store, name: str, epoch: int | None) -> None:
    store.fs.pipe_file(store._path(name), b"x")
    store.fs.pipe_file(store._path(name + ".committed"), json.dumps(
        {"name": name, "objects": {"": 1}, "sharded": False, "epoch": epoch}).encode())


def test_markers_a_stale_writer_slipped_in_are_outside_the_lineage(url):
    """The instant between a writer's check and its marker: that marker is passed over by every reader."""
    store = _store(url)
    a = store.lease({"cluster": "alpha"})
    a.take(None)
    for step in (4, 8):
        _marker(store, f"ckpt-e00001-s{step:09d}.pt", 1)
    b = store.lease({"cluster": "beta"})
    b.take(8)  # beta resumes from step 8
    _marker(store, "ckpt-e00001-s000000012.pt", 1)  # alpha's, after beta took over
    _marker(store, "ckpt-e00001-s000000016.pt", 2)  # beta's own
    names = [name for _, name in store.committed()]
    assert names == ["ckpt-e00001-s000000004.pt", "ckpt-e00001-s000000008.pt", "ckpt-e00001-s000000016.pt"]
    assert store.newest() == (16, "ckpt-e00001-s000000016.pt")
    assert _lease.in_lineage(12, None, _lease.history(store.fs, store.root)) is False  # no epoch: from before


def _train(out: Path, store: str, cluster: str, **env: object) -> subprocess.Popen:
    """One training attempt of the run (tests/_store_train.py on one process), as if on cluster ``cluster``."""
    full = {**os.environ, "STORE": store, "TRAINSTACK_CLUSTER": cluster, "PYTHONPATH": str(ROOT),
            "RANK": "0", **{k: str(v) for k, v in env.items()}}
    return subprocess.Popen([sys.executable, SCRIPT, str(out)], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_two_clusters_running_one_run_end_with_one_lineage_and_the_stale_writer_named(bucket, tmp_path):
    """A split brain: alpha trains slowly; beta starts the same run from the store and takes it over; alpha's next
    commit is refused and it stops, naming beta; the store's lineage is alpha's up to beta's start, then beta's."""
    url = f"s3://{bucket}/split"
    alpha = _train(tmp_path / "alpha", url, "alpha", STEPS=400, EVERY=2, STEP_SLEEP=0.25)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(step >= 4 for (step, _), _ in _store(url).committed()):
            time.sleep(0.2)
        beta = _train(tmp_path / "beta", url, "beta", STEPS=200, EVERY=2, STEP_SLEEP=0.05)
        beta_out, _ = beta.communicate(timeout=180)
        assert beta.returncode == 0, beta_out[-3000:]
        alpha_out, _ = alpha.communicate(timeout=180)
    finally:
        for proc in (alpha,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert alpha.returncode != 0, alpha_out[-3000:]
    assert "another attempt took this run over" in alpha_out and "by beta" in alpha_out, alpha_out[-3000:]
    assert "this attempt writes" in beta_out and "as epoch 2 after alpha" in beta_out
    assert "bitwise equality held (same GPU model, driver, CUDA, NCCL, torch and layout)" in beta_out
    store = _store(url)
    epochs = _lease.history(store.fs, store.root)
    base = epochs[-1]["base_step"]
    assert [e["cluster"] for e in epochs] == ["alpha", "beta"] and base >= 4
    lineage = store.committed()
    assert lineage[-1][0][0] > base and store.manifest(lineage[-1][1])["epoch"] == 2  # beta's is the newest
    for (step, _), name in lineage:
        epoch = store.manifest(name).get("epoch")
        assert (epoch == 1 and step <= base) or epoch == 2, (name, epoch, base)
    lines = _lease.describe(url)
    assert lines[0].endswith("2 attempt(s); the writer now is epoch 2 (beta on " + epochs[-1]["host"] + ")")
    assert "epoch 1: alpha" in lines[1] and "fresh" in lines[1]
    assert "epoch 2: beta" in lines[2] and f"from step {base}" in lines[2]


def test_the_portability_contract_names_what_changed():
    same = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580", "cuda": "13.0", "nccl": "2.29.7", "torch": "2.13.0",
            "world_size": 16, "layout": "2 node(s), 16 process(es)"}
    assert "bitwise equality held" in _lease.portability(same, dict(same))
    moved = {**same, "gpu": "NVIDIA A100-SXM4-80GB", "world_size": 8, "layout": "1 node(s), 8 process(es)"}
    said = _lease.portability(same, moved)
    assert said.startswith("exact data position and optimizer state hold; bitwise equality NOT guaranteed: ")
    assert "gpu NVIDIA H100 80GB HBM3 -> NVIDIA A100-SXM4-80GB" in said and "world_size 16 -> 8" in said
    assert _lease.portability(None, same) == "first attempt of this run"


@ci_leaves_out("two clusters on one run: test_two_clusters_running_one_run_end_with_one_lineage")
def test_a_checkpoint_staged_in_a_clusters_scratch_is_taken_instead_of_downloaded(bucket, tmp_path):
    """trainstack checkpoint stage puts the newest committed checkpoint in a scratch folder while the job waits; the
    job takes it from there when it matches its marker, and downloads it when it does not."""
    url = f"s3://{bucket}/staged"
    first = _train(tmp_path / "alpha", url, "alpha", STEPS=8, EVERY=4)
    out, _ = first.communicate(timeout=180)
    assert first.returncode == 0, out[-3000:]
    scratch = tmp_path / "scratch"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    staged = subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "stage", url, str(scratch)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert staged.returncode == 0 and "staged ckpt-" in staged.stdout, staged.stdout + staged.stderr
    name = staged.stdout.split()[1]
    beta = _train(tmp_path / "beta", url, "beta", STEPS=12, EVERY=4, TRAINSTACK_STAGED=scratch)
    out, _ = beta.communicate(timeout=180)
    assert beta.returncode == 0, out[-3000:]
    assert f"took checkpoint {name} pre-staged in {scratch}" in out and "downloaded checkpoint" not in out, out
    store = _store(url)
    record = _lease.attempts(store.fs, store.root)[-1]
    assert record["cluster"] == "beta" and record["staged"] is True and record["downloaded"] == name
    first_record = _lease.attempts(store.fs, store.root)[0]
    assert len(record["config_hash"]) == 16
    assert record["config_hash"] != first_record["config_hash"]  # max_steps 8 -> 12: the records tell them apart
    assert set(record["image"]) >= {"path"} and isinstance(record["code"], dict)
    # a staged copy that does not match its marker is not taken: the store's own copy is downloaded
    again = subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "stage", url, str(scratch)],
                           capture_output=True, text=True, timeout=120, env=env)
    newest = again.stdout.split()[1]
    assert newest != name
    victim = scratch / newest
    victim.write_bytes(victim.read_bytes()[:-10])
    gamma = _train(tmp_path / "gamma", url, "gamma", STEPS=16, EVERY=4, TRAINSTACK_STAGED=scratch)
    out, _ = gamma.communicate(timeout=180)
    assert gamma.returncode == 0, out[-3000:]
    assert "took checkpoint" not in out and f"downloaded checkpoint {newest}" in out, out
    assert "not taking the pre-staged" in out and "its sizes differ" in out, out
    # probe 5 B23: another run's checkpoint of the same size (same architecture) is refused by its sha256, and one
    # in a staged folder others can write is refused outright
    def stage_newest() -> str:
        subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", "stage", url, str(scratch)], check=True,
                       capture_output=True, timeout=120, env=env)
        return _store(url).newest()[1]

    other = stage_newest()
    (scratch / other).write_bytes(_flipped(store, other))
    delta = _train(tmp_path / "delta", url, "delta", STEPS=20, EVERY=4, TRAINSTACK_STAGED=scratch)
    out, _ = delta.communicate(timeout=180)
    assert delta.returncode == 0 and "took checkpoint" not in out and "(sha256)" in out, out[-3000:]
    assert f"downloaded checkpoint {other}" in out, out[-3000:]
    newest_now = stage_newest()
    scratch.chmod(0o777)
    epsilon = _train(tmp_path / "epsilon", url, "epsilon", STEPS=24, EVERY=4, TRAINSTACK_STAGED=scratch)
    out, _ = epsilon.communicate(timeout=180)
    assert epsilon.returncode == 0 and "writable by others" in out and f"downloaded checkpoint {newest_now}" in out


def _flipped(store, name: str) -> bytes:
    """The committed checkpoint ``name`` with one byte changed: the same size, other content."""
    data = bytearray(store.fs.cat_file(store._path(name)))
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


# ---------------------------------------------------------------- the store read back as data (probe 5, B2-B35)
def test_a_lease_rewritten_backwards_never_reuses_an_epoch_or_an_attempt_record(url):
    """Probe B35: lease.json rewritten to epoch 1 over epochs 1..3; the next take is epoch 4, and no attempt record
    is overwritten."""
    store = _store(url)
    for cluster in ("a", "b", "c"):
        store.lease({"cluster": cluster}).take(None)
    store.fs.pipe_file(store._path("lease.json"), json.dumps(
        {"epoch": 1, "holder": {"cluster": "forger"}, "epochs": [{"epoch": 1, "base_step": None}]}).encode())
    assert store.lease({"cluster": "d"}).take(None) == 4
    assert [r["cluster"] for r in _lease.attempts(store.fs, store.root)] == ["a", "b", "c", "d"]


def test_epochs_that_do_not_increase_are_passed_over_and_said(url, caplog):
    store = _store(url)
    store.fs.makedirs(store.root, exist_ok=True)
    store.fs.pipe_file(store._path("lease.json"), json.dumps({"epoch": 3, "epochs": [
        {"epoch": 2, "base_step": None}, {"epoch": 1, "base_step": 4}, {"epoch": "3", "base_step": 0},
        {"epoch": 3, "base_step": -1}, {"epoch": 5, "base_step": 8}]}).encode())
    assert [e["epoch"] for e in _lease.history(store.fs, store.root)] == [2, 5]
    assert caplog.text.count("passing over an epoch") == 3


@pytest.mark.parametrize("record", [b"{{{", b"[1]", b'{"epoch": 1, "taken": 1e300}', b'{"epoch": 1, "taken": NaN}'])
def test_a_garbage_attempt_record_is_passed_over_by_status_and_by_the_next_attempt(url, record):
    """Probe B6, B8, B9, B15, B16: `status STORE` and a new attempt's start read past it."""
    store = _store(url)
    store.lease({"cluster": "a"}).take(None)
    store.fs.pipe_file(store._path("attempts/epoch-0001.json"), record)
    lines = _lease.describe(url)
    assert lines[0].startswith(f"{url}: 1 attempt(s)"), lines
    assert any("passed over" in line for line in lines) or "an unknown time" in "\n".join(lines), lines
    from trainstack._train.runstore import take_lease

    said: list[str] = []
    assert take_lease(store, 1, said.append) is not None and "as epoch 2" in said[0], said


def test_status_of_a_store_says_what_is_wrong_with_it(bucket, tmp_path):
    """Probe B7, B13, B14: a garbage lease, a missing bucket, an endpoint that does not answer."""
    url = f"s3://{bucket}/r"
    store = _store(url)
    store.fs.makedirs(store.root, exist_ok=True)
    for garbage in (b"garbage", b"[1,2,3]"):
        store.fs.pipe_file(store._path("lease.json"), garbage)
        (line,) = _lease.describe(url)
        assert "lease.json" in line and ("not JSON" in line or "not a lease record" in line), line
    assert "no such bucket" in _lease.describe("s3://ts-no-such-bucket-x/r")[0]
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "PYTHONPATH": str(ROOT),
           "TRAINSTACK_STORE_TIMEOUT": "2"}
    done = subprocess.run([sys.executable, "-m", "trainstack", "status", url], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "cannot read the checkpoint store" in \
        done.stderr and "AWS_ENDPOINT_URL" in done.stderr, done.stderr


def test_a_forged_lease_dropping_the_lineage_is_said(url, caplog):
    """Probe B19: a lease forged to epochs [1 fresh, 999 from step 0] passes over three good checkpoints: said."""
    store = _store(url)
    store.lease({"cluster": "a"}).take(None)
    for step in (4, 8, 12):
        _marker(store, f"ckpt-e00000-s{step:09d}.pt", 1)
    store.fs.pipe_file(store._path("lease.json"), json.dumps({"epoch": 999, "epochs": [
        {"epoch": 1, "base_step": None}, {"epoch": 999, "base_step": 0}]}).encode())
    assert store.committed() == []
    assert "passing over 3 committed checkpoint(s)" in caplog.text and "999 from step 0" in caplog.text


@pytest.mark.parametrize("marker", [b"[]", b"{{{", b"5"])
@pytest.mark.parametrize("takeover", [False, True])
def test_a_damaged_newest_marker_is_passed_over_like_a_damaged_checkpoint(url, tmp_path, marker, takeover):
    """Probe B17, B18, B28: the run resumes from the one before it, said; with a staged folder too (after a
    takeover, markers past its step have their epoch read: B17's AttributeError)."""
    from trainstack._train.runstore import pull_newer
    from trainstack.checkpoint import Checkpointer

    store = _store(url)
    store.lease({"cluster": "a"}).take(None)
    if takeover:
        store.lease({"cluster": "b"}).take(4)
    local = tmp_path / "ckpt-e00000-s000000004.pt"
    import torch

    torch.save({"x": 1}, local)
    store.upload(local)
    store.fs.pipe_file(store._path("ckpt-e00000-s000000008.pt"), b"x")
    store.fs.pipe_file(store._path("ckpt-e00000-s000000008.pt.committed"), marker)
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "ckpt-e00000-s000000008.pt").write_bytes(b"x")
    os.environ["TRAINSTACK_STAGED"] = str(staged)
    try:
        said: list[str] = []
        checkpointer = Checkpointer(tmp_path / "run", None, True, False)
        pull_newer(store, checkpointer, True, said.append)
    finally:
        del os.environ["TRAINSTACK_STAGED"]
    assert any("downloaded checkpoint ckpt-e00000-s000000004.pt" in line for line in said), said
    assert (checkpointer.folder / "ckpt-e00000-s000000004.pt").exists()
    assert takeover or any("passing over ckpt-e00000-s000000008.pt" in line for line in said), said


def test_a_writer_that_lost_the_lease_on_its_last_save_does_not_end_as_a_success(url, tmp_path):
    """Probe B2: its refused upload leaves no object behind, and the run's end raises StaleLease (exit non-zero)."""
    from trainstack._checkpoint.store import Uploads
    from trainstack._train.runstore import finish_uploads

    store = _store(url)
    lease = store.lease({"cluster": "a"})
    lease.take(None)
    store.lease({"cluster": "b"}).take(None)  # b takes the run over before a's last save
    local = tmp_path / "ckpt-e00000-s000000008.pt"
    local.write_bytes(b"weights")
    said: list[str] = []
    up = Uploads(store, None, said.append, lease)
    up.submit(local)
    with pytest.raises(_lease.StaleLease, match="another attempt took this run over"):
        finish_uploads(up, False, said.append)
    assert not store.fs.exists(store._path(local.name)) and store.committed() == []

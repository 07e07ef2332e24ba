"""Checkpoints committed to an object store: a real S3-compatible server (moto's server mode) on 127.0.0.1, started
and stopped by pid; training under torchrun (2 gloo processes) commits there, a save killed mid-upload leaves the
previous checkpoint the newest, a run on "another machine" (an empty run folder) resumes from the store bitwise --
sharded FSDP checkpoints at another world size too -- and inspect/consolidate/export read the URL."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ci_leaves_out, moto_s3, torchrun_exe

pytest.importorskip("s3fs")
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).with_name("_store_train.py"))


def _torchrun(run_py, out: Path, store: str, nprocs: int = 2, check: bool = True, **env: object):
    """Steps of 0.15 s unless told: each upload (milliseconds to moto) ends before the next save, so every periodic
    checkpoint reaches the store (a save made while one uploads would wait in the slot, and a newer one replace it)."""
    env.setdefault("STEP_SLEEP", 0.15)
    return run_py([torchrun_exe(), "--standalone", "--nproc_per_node", str(nprocs), "--max-restarts", "0",
                   "--monitor-interval", "0.2", SCRIPT, str(out)], timeout=240, check=check,
                  env={"STORE": store, **{k: str(v) for k, v in env.items()}})


def _committed(url: str) -> list[str]:
    from trainstack._checkpoint.store import Store

    return [name for _, name in Store(url).committed()]


def _same(a: Path, b: Path, ranks: int = 1) -> None:
    for rank in range(ranks):
        mine, ref = torch.load(a / f"final-rank{rank}.pt"), torch.load(b / f"final-rank{rank}.pt")
        assert [k for k in ref if not torch.equal(mine[k], ref[k])] == []


def test_a_save_killed_mid_upload_keeps_the_previous_and_another_machine_resumes_bitwise(run_py, tmp_path, bucket):
    """File checkpoints every 4 steps to s3://; rank 0 killed while uploading step 8's (objects up, no marker):
    step 4 stays the newest committed; a run with an empty run folder downloads it and ends equal to an
    uninterrupted run, bit for bit; keep_last_checkpoints=1 holds in the store."""
    _torchrun(run_py, tmp_path / "ref", f"s3://{bucket}/ref")
    store = f"s3://{bucket}/cut"
    cut = _torchrun(run_py, tmp_path / "cut", store, check=False, DIE_UPLOADING=8, KEEP=1)
    assert cut.returncode != 0
    import s3fs

    listed = [p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem(skip_instance_cache=True).ls(f"{bucket}/cut")]
    assert "ckpt-e00000-s000000008.pt" in listed and "ckpt-e00000-s000000008.pt.committed" not in listed, listed
    assert _committed(store) == ["ckpt-e00000-s000000004.pt"]
    resumed = _torchrun(run_py, tmp_path / "elsewhere", store, KEEP=1)
    assert "downloaded checkpoint ckpt-e00000-s000000004.pt from s3://" in resumed.stdout, resumed.stdout[-3000:]
    assert "Resumed from" in resumed.stdout and "step 4" in resumed.stdout
    assert "Checkpoints committed to s3://" in resumed.stdout
    _same(tmp_path / "elsewhere", tmp_path / "ref", ranks=2)
    assert _committed(store) == ["ckpt-e00000-s000000012.pt"]  # keep_last_checkpoints=1, in the store too


@ci_leaves_out("resharding: tests/distributed/test_parallel.py; the store: the other tests here")
def test_sharded_fsdp_checkpoints_on_s3_resume_at_another_world_size(run_py, tmp_path, bucket):
    """FSDP2 on 2 processes, sharded (DCP) checkpoints written asynchronously and committed to s3://; killed while
    uploading step 8's; one process on an empty run folder resumes from step 4's shards in the store; the CLI
    inspects, consolidates and exports the URL."""
    store = f"s3://{bucket}/fsdp"
    cut = _torchrun(run_py, tmp_path / "cut", store, check=False, STRATEGY="fsdp", ASYNC=1, DIE_UPLOADING=8)
    assert cut.returncode != 0 and _committed(store) == ["ckpt-e00000-s000000004"]
    resumed = _torchrun(run_py, tmp_path / "one", store, nprocs=1, STRATEGY="fsdp")
    assert "downloaded checkpoint ckpt-e00000-s000000004 from" in resumed.stdout, resumed.stdout[-3000:]
    assert "step 4" in resumed.stdout and _committed(store)[-1] == "ckpt-e00000-s000000012"

    inspect = run_py([sys.executable, "-m", "trainstack", "checkpoint", "inspect", store], timeout=120).stdout
    assert "sharded" in inspect and "12" in inspect, inspect
    assert re.search(rf"^checkpoint +{store}/ckpt-e00000-s000000012$", inspect, re.M), inspect  # not a temp copy
    out = tmp_path / "whole.pt"
    run_py([sys.executable, "-m", "trainstack", "checkpoint", "consolidate", f"{store}/ckpt-e00000-s000000012", "-o",
            str(out)], timeout=120)
    final = torch.load(tmp_path / "one" / "final-rank0.pt")
    whole = torch.load(out)
    assert whole.keys() == final.keys() and all(torch.equal(whole[k], final[k]) for k in final)
    run_py([sys.executable, "-m", "trainstack", "checkpoint", "export", store, "-o", str(tmp_path / "st")],
           timeout=120)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert all(torch.equal(exported[k], final[k]) for k in final)


def test_an_unreachable_store_is_a_clear_error_before_training(tmp_path, bucket):
    from torch import nn

    from trainstack import TrainConfig, Trainer
    from trainstack.errors import ConfigError

    model = nn.Linear(2, 1)
    cfg = TrainConfig(max_iter=1, log_folder=tmp_path / "run", checkpoint_store=f"s3://{bucket}-missing/x",
                      compute_setup="cpu")
    with pytest.raises(ConfigError, match=rf"checkpoint store s3://{bucket}-missing/x is not reachable"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn="mse").fit(
            [(torch.randn(4, 2), torch.randn(4, 1))])
    assert not (tmp_path / "run").exists()  # a refused store leaves no run folder behind (it used to)


def test_a_url_without_its_client_or_a_plain_path_is_refused_clearly():
    from trainstack import TrainConfig
    from trainstack._checkpoint.store import Store
    from trainstack.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint_store='runs/ckpts' must be a URL"):
        TrainConfig(checkpoint_store="runs/ckpts")
    if shutil.which("gcsfs") is None:
        with contextlib.suppress(ModuleNotFoundError):
            import gcsfs  # noqa: F401
            return
        with pytest.raises(ConfigError, match=r"gs:// needs gcsfs.*pip install gcsfs"):
            Store("gs://bucket/x")


def _forge(bucket: str, prefix: str, objects: dict[str, bytes], listed: dict[str, int] | None = None) -> str:
    """A committed sharded checkpoint written by hand into the bucket: its objects and a marker listing
    ``listed`` (default: the objects' own names and sizes)."""
    import json

    import s3fs

    fs, name = s3fs.S3FileSystem(skip_instance_cache=True), "ckpt-e00009-s000000999"
    for rel, body in objects.items():
        fs.pipe_file(f"{bucket}/{prefix}/{name}/{rel}", body)
    marker = {"objects": listed if listed is not None else {rel: len(b) for rel, b in objects.items()},
              "sharded": True}
    fs.pipe_file(f"{bucket}/{prefix}/{name}.committed", json.dumps(marker).encode())
    return f"s3://{bucket}/{prefix}"


def test_a_marker_naming_a_path_outside_its_checkpoint_writes_nothing_anywhere(run_py, tmp_path, bucket):
    """A marker someone wrote into the bucket whose object name climbs out (``../../...``) is refused before any
    byte is written: by ``checkpoint inspect URL`` (a clear error, no traceback) and by ``resume="auto"`` (the
    checkpoint passed over, said; the run trains from scratch)."""
    target = tmp_path / "PWNED.txt"
    climb = "../" * 24 + str(target).lstrip("/")  # lands on target from any depth, where the names are not checked
    url = _forge(bucket, "evil", {climb: b"echo owned\n", ".metadata": b"abc"})
    inspect = run_py([sys.executable, "-m", "trainstack", "checkpoint", "inspect", url], timeout=120, check=False)
    assert inspect.returncode != 0 and not target.exists()
    assert "outside the checkpoint" in inspect.stdout and "Traceback" not in inspect.stdout, inspect.stdout[-2000:]
    run = _torchrun(run_py, tmp_path / "out", url, nprocs=1, STEPS=2, EVERY=100)
    assert not target.exists() and not list(tmp_path.rglob("PWNED.txt"))
    assert "passing over ckpt-e00009-s000000999 in the store" in run.stdout, run.stdout[-3000:]
    assert "outside the checkpoint" in run.stdout


def test_a_marker_listing_objects_the_prefix_does_not_hold_is_refused(tmp_path, bucket):
    """The marker is checked against a listing of the checkpoint's own prefix: an object it names that the store
    does not hold there (the name of a file elsewhere in the bucket) is refused, and a single-file marker that
    lists folder objects too."""
    from trainstack._checkpoint.store import Store
    from trainstack.errors import CheckpointError

    url = _forge(bucket, "odd", {".metadata": b"abc"}, listed={".metadata": 3, "__0_0.distcp": 10})
    with pytest.raises(CheckpointError, match=r"does not hold under the checkpoint's prefix.*__0_0.distcp"):
        Store(url).download("ckpt-e00009-s000000999", tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing left behind, not even a temp folder
    with pytest.raises(CheckpointError, match=r"not a checkpoint name"):
        Store(url).download("../../etc", tmp_path)


@ci_leaves_out("the fallback: tests/test_dcp.py; the store: the other tests here")
def test_a_damaged_newest_checkpoint_in_the_store_is_passed_over_for_the_one_before(run_py, tmp_path, bucket):
    """The newest committed checkpoint's object does not match its marker (damaged in the store): a run on an
    empty run folder says so, downloads the one before, leaves no temp file and ends equal to the unbroken run."""
    import json

    import s3fs

    store = f"s3://{bucket}/dmg"
    _torchrun(run_py, tmp_path / "ref", store, STEPS=12)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    marker = f"{bucket}/dmg/ckpt-e00000-s000000012.pt.committed"
    manifest = json.loads(fs.cat_file(marker))
    manifest["objects"][""] += 7
    fs.pipe_file(marker, json.dumps(manifest).encode())
    resumed = _torchrun(run_py, tmp_path / "again", store, STEPS=12)
    assert "passing over ckpt-e00000-s000000012.pt in the store" in resumed.stdout, resumed.stdout[-3000:]
    assert "damaged copy" in resumed.stdout
    assert "downloaded checkpoint ckpt-e00000-s000000008.pt" in resumed.stdout and "step 8" in resumed.stdout
    assert not [p for p in (tmp_path / "again").rglob("*") if ".tmp-" in p.name]
    _same(tmp_path / "again", tmp_path / "ref", ranks=2)


def test_a_store_that_stops_answering_never_stops_training(run_py, tmp_path, monkeypatch):
    """A server of its own, frozen (SIGSTOP: connections accepted, nothing answered -- a black-holed gateway).
    Frozen before the start: the check gives up within TRAINSTACK_STORE_TIMEOUT, naming the URL. Frozen at step 4
    of a run that commits a checkpoint every 2 steps: training goes on to its last step -- uploads fail or are
    skipped, each said -- and the end waits a bounded time for the last upload, said; exit 0."""
    import s3fs

    with moto_s3() as (env, server):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("frozen")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            early = _torchrun(run_py, tmp_path / "early", "s3://frozen/x", nprocs=1, check=False, STEPS=2,
                              TRAINSTACK_STORE_TIMEOUT=3)
            assert time.monotonic() - start < 60 and early.returncode != 0
            assert "checkpoint store s3://frozen/x did not answer within 3 s" in early.stdout, early.stdout[-3000:]
        finally:
            os.kill(server.pid, signal.SIGCONT)
        start = time.monotonic()
        try:
            run = _torchrun(run_py, tmp_path / "late", "s3://frozen/y", nprocs=2, STEPS=16, EVERY=2, STEP_SLEEP=0.2,
                            FREEZE_AT=4, FREEZE_PID=server.pid, TRAINSTACK_STORE_TIMEOUT=2)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        took = time.monotonic() - start
        out = run.stdout
        assert "froze the store at step 4" in out and (tmp_path / "late" / "final-rank0.pt").exists(), out[-3000:]
        assert "could not upload checkpoint" in out or "is still running after" in out, out[-3000:]
        assert out.count("froze the store") == 1
        assert "did not finish within 10 s" in out or "Checkpoints committed to" in out, out[-3000:]
        assert took < 120, took


def test_an_upload_a_kill_left_unfinished_is_aborted_when_the_run_starts_again(bucket):
    """A multipart upload of the run's prefix that a killed upload left (invisible to listings, billed) is aborted
    by the next check of the store; one of another prefix is left alone."""
    import s3fs

    from trainstack._checkpoint.store import Store

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for key in ("run/ckpt-e00000-s000000040.pt", "other/x"):
        fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    Store(f"s3://{bucket}/run").check()
    left = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") or []
    assert [u["Key"] for u in left] == ["other/x"]

"""Sharded (DCP) checkpoints read safely: a planted .metadata never runs code, damage is named and skipped."""

from __future__ import annotations

import operator
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from trainstack._checkpoint import sharded as _dcp
from trainstack.checkpoint import Checkpointer, CheckpointError, check_fits, consolidate, describe


def _parts(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


def _save(folder, step: int, seed: int = 0):
    ckpt = Checkpointer(folder, sharded=True)
    return ckpt.save({"epoch": step, "global_step": step}, _parts(seed))


class _Canary:
    """What the probe planted: running it touches a file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Wrapper:
    """Wraps the real metadata so everything looks normal, while unpickling runs the canary first."""

    def __init__(self, real, canary):
        self.real, self.canary = real, canary

    def __reduce__(self):
        return (operator.getitem, ((self.canary, self.real), 1))


def _plant(ckpt, canary_path):
    with open(ckpt / ".metadata", "rb") as fh:
        real = pickle.load(fh)  # the test's own file: trusted
    with open(ckpt / ".metadata", "wb") as fh:
        pickle.dump(_Wrapper(real, _Canary(canary_path)), fh)


def test_a_planted_metadata_pickle_never_runs(tmp_path):
    run = tmp_path / "run"
    path = _save(run, 1)
    canary = tmp_path / "CANARY"
    _plant(path, canary)
    for read in (lambda: describe(run), lambda: consolidate(run), lambda: check_fits(nn.Linear(4, 3), path),
                 lambda: Checkpointer(run).restore(_parts(1))):
        with pytest.raises(CheckpointError, match="no readable checkpoint|damaged|refusing"):
            read()
    assert not canary.exists()


def test_a_planted_metadata_pickle_never_runs_in_the_cli(tmp_path):
    run = tmp_path / "run"
    _plant(_save(run, 1), tmp_path / "CANARY")
    for sub in (["inspect", str(run)], ["consolidate", str(run), "-o", str(tmp_path / "m.pt")]):
        proc = subprocess.run([sys.executable, "-m", "trainstack", "checkpoint", *sub], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "refusing to load posix.system" in proc.stderr or "refusing to load" in proc.stderr
    assert not (tmp_path / "CANARY").exists()


def test_non_tensor_items_are_loaded_weights_only(tmp_path):
    """DCP's own planner loads BYTE_IO items with weights_only=False; ours refuses what is not plain data."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ck"
    dcp.save({"model": {"w": torch.ones(2)}, "extra": {"obj": _Canary(tmp_path / "CANARY")}},
             checkpoint_id=str(folder), no_dist=True)
    state = {"model": {"w": torch.zeros(2)}, "extra": {"obj": None}}
    with pytest.raises(BaseException, match="Weights only load failed"):  # DCP wraps it in a BaseException
        dcp.load(state, storage_reader=_dcp._reader(folder), planner=_dcp._planner(), no_dist=True)
    assert not (tmp_path / "CANARY").exists()


@pytest.mark.parametrize("damage", ["truncate-shard", "remove-shard", "garbage-metadata", "empty-metadata",
                                    "remove-metadata", "huge-tensor", "fifo-extras", "huge-frame-metadata"])
def test_a_damaged_newest_sharded_checkpoint_falls_back_to_the_previous(tmp_path, damage, capsys):
    run = tmp_path / "run"
    _save(run, 1, seed=1)
    newest = _save(run, 2, seed=2)
    shard = next(newest.glob("*.distcp"))
    if damage == "truncate-shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "remove-shard":
        shard.unlink()
    elif damage == "garbage-metadata":
        (newest / ".metadata").write_bytes(os.urandom(200))
    elif damage == "huge-frame-metadata":  # a pickle FRAME longer than any process: OverflowError, not a crash
        (newest / ".metadata").write_bytes(b"\x80\x04\x95" + (2**64 - 1).to_bytes(8, "little"))
    elif damage == "empty-metadata":
        (newest / ".metadata").write_bytes(b"")
    elif damage == "remove-metadata":
        (newest / ".metadata").unlink()
    elif damage == "huge-tensor":
        meta = _dcp.read_metadata(newest)
        key = next(k for k in meta.state_dict_metadata if k.startswith("model."))
        meta.state_dict_metadata[key].size = torch.Size([10**13])
        with open(newest / ".metadata", "wb") as fh:
            pickle.dump(meta, fh)
    else:
        (newest / _dcp.EXTRAS).unlink()
        os.mkfifo(newest / _dcp.EXTRAS)
    parts = _parts(9)
    restored = Checkpointer(run).restore(parts)
    assert restored is not None and restored.counters["global_step"] == 1
    expected = _parts(1)["model"].state_dict()
    assert all(torch.equal(parts["model"].state_dict()[k], v) for k, v in expected.items())
    assert "unreadable" in capsys.readouterr().out
    assert describe(run)["step"] == 1  # inspect names the readable one, no traceback, no hang
    with pytest.raises(CheckpointError, match="damaged|not a regular file|truncated|missing"):
        describe(newest)


def test_verify_refuses_shard_paths_outside_the_checkpoint(tmp_path):
    path = _save(tmp_path / "run", 1)
    meta = _dcp.read_metadata(path)
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(meta, fh)
    with pytest.raises(_dcp.DamagedCheckpoint, match="outside the checkpoint"):
        _dcp.verify(path)


@pytest.mark.parametrize("sharded", [True, False])
def test_inspect_and_consolidate_of_a_live_run_that_rotates_its_checkpoints(tmp_path, sharded):
    """A run keeping one checkpoint deletes the newest one as soon as it writes the next: reading the run folder
    meanwhile follows to the new newest instead of failing."""
    import threading

    run = tmp_path / "run"
    ckpt = Checkpointer(run, keep_last=1, sharded=sharded)
    parts = _parts()
    ckpt.save({"epoch": 0, "global_step": 0}, parts)
    stop = threading.Event()

    def train():
        step = 1
        while not stop.is_set():
            ckpt.save({"epoch": step, "global_step": step}, parts)
            step += 1

    writer = threading.Thread(target=train)
    writer.start()
    try:
        for _ in range(10):
            assert describe(run)["parameters"] == 15
            assert set(consolidate(run)) == {"weight", "bias"}
    finally:
        stop.set()
        writer.join()

"""Atomic checkpoint files: a write interrupted at any point never replaces the last good checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from trainstack.checkpoint import Checkpointer, CheckpointError, atomic_save, capture_rng, restore_rng


def _state(step):
    return {"format_version": 1, "epoch": step, "global_step": step, "w": torch.full((1000,), float(step))}


def test_latest_ignores_temp_files_and_foreign_names(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(_state(1), "ckpt-e00001-s000000010.pt", is_main=True)
    (ck.folder / ".ckpt-e00002-s000000020.pt.tmp-123").write_bytes(b"half")
    (ck.folder / "notes.pt").write_bytes(b"x")
    assert ck.latest().name == "ckpt-e00001-s000000010.pt"


def test_steps_sort_numerically_and_rotation_keeps_best(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step in (5, 50, 500):
        ck.save(_state(step), f"ckpt-e{step:05d}-s{step:09d}.pt", is_main=True)
    ck.save(_state(1), "best.pt", is_main=True)
    assert [p.name for p in ck.checkpoints()] == ["ckpt-e00050-s000000050.pt", "ckpt-e00500-s000000500.pt"]
    assert (ck.folder / "best.pt").exists()
    assert ck.save(_state(1), "x.pt", is_main=False) is None


def test_write_error_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(_state(1), "ckpt-e00001-s000000001.pt", is_main=True)

    def disk_full(obj, fh):
        fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="the disk is full. The previous checkpoint is kept"):
        ck.save(_state(2), "ckpt-e00002-s000000002.pt", is_main=True)
    assert ck.latest().name == "ckpt-e00001-s000000001.pt"
    assert sorted(p.name for p in ck.folder.iterdir()) == ["ckpt-e00001-s000000001.pt"]


def test_permission_error_is_clear_and_cleans_up(tmp_path, monkeypatch):
    def denied(src, dst):  # what a read-only target directory does to a non-root user
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", denied)
    with pytest.raises(CheckpointError, match="permission denied"):
        atomic_save(_state(1), tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_sigkill_during_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(_state(1), "ckpt-e00001-s000000001.pt", is_main=True)
    marker = tmp_path / "writing"
    code = ("import torch; from trainstack.checkpoint import Checkpointer; "
            f"Checkpointer({str(tmp_path)!r}).save({{'format_version': 1, 'w': torch.zeros(10**6)}}, "
            "'ckpt-e00002-s000000002.pt', is_main=True)")
    env = {**os.environ, "TRAINSTACK_TEST_SAVE_DELAY_S": "30", "TRAINSTACK_TEST_SAVE_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 40
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the writer never reached the commit point"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    latest = ck.latest()
    assert latest.name == "ckpt-e00001-s000000001.pt"
    assert torch.equal(torch.load(latest, weights_only=True)["w"], _state(1)["w"])


def test_rng_round_trip_is_weights_only_safe(tmp_path):
    import random

    import numpy as np

    state = capture_rng()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected

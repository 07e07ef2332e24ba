"""Atomic checkpoint files: a write interrupted at any point never replaces the last good checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from trainstack.checkpoint import Checkpointer, CheckpointError, atomic_save, capture_rng, restore_rng


def _state(step):
    return {"format_version": 1, "epoch": step, "global_step": step, "w": torch.full((1000,), float(step))}


def test_latest_ignores_temp_files_and_foreign_names(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.write(_state(1), "ckpt-e00001-s000000010.pt")
    (ck.folder / ".ckpt-e00002-s000000020.pt.tmp-123").write_bytes(b"half")
    (ck.folder / "notes.pt").write_bytes(b"x")
    assert ck.latest().name == "ckpt-e00001-s000000010.pt"


def test_steps_sort_numerically_and_rotation_keeps_best(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step in (5, 50, 500):
        ck.write(_state(step), f"ckpt-e{step:05d}-s{step:09d}.pt")
    ck.write(_state(1), "best.pt")
    assert [p.name for p in ck.checkpoints()] == ["ckpt-e00050-s000000050.pt", "ckpt-e00500-s000000500.pt"]
    assert (ck.folder / "best.pt").exists()
    assert Checkpointer(tmp_path, is_main=False).save({"epoch": 1, "global_step": 1}, {}) is None


def test_write_error_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.write(_state(1), "ckpt-e00001-s000000001.pt")

    def disk_full(obj, fh):
        fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match="the disk is full. The previous checkpoint is kept"):
        ck.write(_state(2), "ckpt-e00002-s000000002.pt")
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
    ck.write(_state(1), "ckpt-e00001-s000000001.pt")
    marker = tmp_path / "writing"
    # the writer pauses at its commit point (the rename): the file is fully written but not yet committed
    code = ("import os, time, torch; from pathlib import Path; from trainstack.checkpoint import Checkpointer\n"
            "real = os.replace\n"
            f"def paused(a, b): Path({str(marker)!r}).touch(); time.sleep(30); real(a, b)\n"
            "os.replace = paused\n"
            f"Checkpointer({str(tmp_path)!r}).write({{'format_version': 1, 'w': torch.zeros(10**6)}}, "
            "'ckpt-e00002-s000000002.pt')")
    proc = subprocess.Popen([sys.executable, "-c", code])
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


def _parts(seed=0, opt="adam"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = (torch.optim.Adam if opt == "adam" else torch.optim.SGD)(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_restore_into_plain_objects_without_a_trainer(tmp_path):
    model, optimizer = _parts(0)
    ck = Checkpointer(tmp_path)
    path = ck.save({"epoch": 3, "global_step": 30}, {"model": model, "optimizer": optimizer})
    assert path.name == "ckpt-e00003-s000000030.pt"
    fresh, fresh_opt = _parts(1)
    restored = Checkpointer(tmp_path).restore({"model": fresh, "optimizer": fresh_opt})
    assert restored.counters["epoch"] == 3 and restored.counters["global_step"] == 30 and restored.path == path
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                 strict=True))
    assert fresh_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert restored.rng is not None and restored.world_size == 1


def test_the_same_step_is_saved_once(tmp_path):
    model, optimizer = _parts()
    ck = Checkpointer(tmp_path)
    assert ck.save({"epoch": 1, "global_step": 5}, {"model": model}) is not None
    assert ck.save({"epoch": 1, "global_step": 5}, {"model": model}) is None  # periodic + final at one step
    assert ck.save({"epoch": 1, "global_step": 5}, {"model": model}, best=True).name == "best.pt"


def test_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    model, optimizer = _parts()
    ck = Checkpointer(tmp_path)
    good = ck.save({"epoch": 1, "global_step": 1}, {"model": model})
    newest = ck.save({"epoch": 2, "global_step": 2}, {"model": model})
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated by a copy
    restored = Checkpointer(tmp_path).restore({"model": _parts(3)[0]})
    assert restored.path == good and restored.counters["epoch"] == 1
    out = capsys.readouterr().out
    assert newest.name in out and good.name in out
    with pytest.raises(CheckpointError, match="damaged"):  # an explicit path never falls back
        Checkpointer(tmp_path).restore({"model": _parts(3)[0]}, newest)


def test_mismatches_are_clear_errors(tmp_path):
    model, adam = _parts(opt="adam")
    Checkpointer(tmp_path).save({"epoch": 1, "global_step": 1}, {"model": model, "optimizer": adam})
    sgd_model, sgd = _parts(opt="sgd")
    with pytest.raises(CheckpointError, match="Adam optimizer, but this run uses SGD"):
        Checkpointer(tmp_path).restore({"model": sgd_model, "optimizer": sgd})
    wider = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with pytest.raises(CheckpointError, match="does not fit this run's model: .*size mismatch"):
        Checkpointer(tmp_path).restore({"model": wider})
    with pytest.raises(CheckpointError, match="is a folder"):
        Checkpointer(tmp_path).restore({"model": model}, tmp_path)


def test_disk_full_inside_torch_is_named_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """torch reports ENOSPC from its zip writer as a RuntimeError; the cause must still be named."""
    ck = Checkpointer(tmp_path)
    ck.write(_state(1), "ckpt-e00001-s000000001.pt")

    def enospc(obj, fh):
        fh.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", enospc)
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255)))
    with pytest.raises(CheckpointError, match="the disk is full"):
        ck.write(_state(2), "ckpt-e00002-s000000002.pt")
    assert sorted(p.name for p in ck.folder.iterdir()) == ["ckpt-e00001-s000000001.pt"]


def test_stale_temp_files_are_removed(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.write(_state(1), "ckpt-e00001-s000000001.pt")
    stale = ck.folder / ".ckpt-e00002-s000000002.pt.tmp-4242"
    stale.write_bytes(b"left by a killed writer")
    assert ck.remove_stale_temp_files() == [stale] and not stale.exists() and ck.latest() is not None


def test_qadence_helpers_write_and_load(tmp_path):
    from trainstack import load_checkpoint, write_checkpoint

    model, optimizer = _parts(0)
    write_checkpoint(tmp_path, model, optimizer, 7)
    fresh, fresh_opt = _parts(5)
    out_model, out_opt, iteration = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert iteration == 7 and out_model is fresh and out_opt is fresh_opt
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert load_checkpoint(tmp_path / "empty", fresh) == (fresh, None, 0)


def test_an_unreadable_file_says_what_it_is_never_to_load_it_unsafely(tmp_path):
    """Not a checkpoint, empty, a refused object (named, with the way out), damaged: each in its own words, and
    never torch's advice to set weights_only=False."""
    good = Checkpointer(tmp_path).save({"epoch": 1, "global_step": 1}, {"model": _parts()[0]})
    cases = {"text.pt": (b"garbage\n", "starts with b'garbage\\n'"), "empty.pt": (b"", "the file is empty"),
             "cut.pt": (good.read_bytes()[:200], "damaged")}
    for name, (data, _) in cases.items():
        (tmp_path / name).write_bytes(data)
    torch.save({"format_version": 1, "x": np.zeros(2)}, tmp_path / "numpy.pt")
    cases["numpy.pt"] = (b"", "holds a numpy")
    for name, (_, expected) in cases.items():
        with pytest.raises(CheckpointError) as err:
            Checkpointer(tmp_path).restore({"model": _parts()[0]}, tmp_path / name)
        assert expected in str(err.value) and name in str(err.value), err.value
        assert "weights_only` set to `False`" not in str(err.value) and "will likely succeed" not in str(err.value)


def test_retention_keeps_the_newest_and_the_protected():
    """One retention rule for the run folder and the store: the newest ``keep_last``, plus any still uploading."""
    from trainstack._checkpoint.retention import rotate

    class Shelf:
        def __init__(self, names):
            self.names = list(names)

        def periodic_names(self):
            return list(self.names)

        def remove(self, name):
            self.names.remove(name)

    shelf = Shelf(["a", "b", "c", "d"])
    assert rotate(shelf, None) == [] and shelf.names == ["a", "b", "c", "d"]
    assert rotate(shelf, 2, keep={"a"}) == ["b"]
    assert shelf.names == ["a", "c", "d"]
    assert rotate(shelf, 1) == ["a", "c"] and shelf.names == ["d"]

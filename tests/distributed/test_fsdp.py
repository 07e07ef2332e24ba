"""FSDP2 on real gloo processes: equal to DDP, sharded checkpoints that resume bitwise on the same world size and
resharded on another one with no sample skipped or repeated, a SIGKILL mid-save, consolidation, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import _fsdp_train as ft
import pytest
import torch
from click.testing import CliRunner
from psutil_free import own_children

from trainstack import Callback, TrainConfig, Trainer
from trainstack.checkpoint import Checkpointer, CheckpointError
from trainstack.cli import main
from trainstack.errors import ConfigError, Preempted

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_fsdp_equals_ddp_with_accumulation_and_clipping(tmp_path):
    ddp = ft.fit(tmp_path / "ddp", 2, "ddp", gradient_accumulation_steps=2, grad_clip_norm=0.5)
    fsdp = ft.fit(tmp_path / "fsdp", 2, "fsdp", gradient_accumulation_steps=2, grad_clip_norm=0.5)
    diff = max((ddp.state_dict()[k] - v).abs().max().item() for k, v in fsdp.state_dict().items())
    assert diff < 1e-5, diff
    ckpt = Checkpointer(tmp_path / "fsdp").latest()
    assert ckpt.is_dir() and (ckpt / "COMMITTED").exists() and len(list(ckpt.glob("__*_0.distcp"))) == 2
    assert Checkpointer(tmp_path / "ddp").latest().is_file()  # ddp keeps one file by default
    assert not own_children()


def _stopped_run(tmp_path, name, monkeypatch):
    folder, stop = tmp_path / name, tmp_path / f"{name}.STOP"
    monkeypatch.setenv("FSDP_STOP", str(stop))
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / f"{name}-ids"))
    with pytest.raises(Preempted):
        ft.fit(folder, 2, callbacks=[Callback(on="train_batch_end", callback=ft.touch_stop_at_step_3)],
               stop_file=stop)
    stop.unlink()
    return folder


def test_a_stopped_fsdp_run_resumes_bitwise_on_the_same_world_size(tmp_path, monkeypatch):
    reference = ft.fit(tmp_path / "ref", 2)
    folder = _stopped_run(tmp_path, "run", monkeypatch)
    state = torch.load(Checkpointer(folder).latest() / "trainstack.pt", weights_only=True)
    assert state["global_step"] == 3 and state["partial_epoch"]["samples_in_epoch"] == 12
    resumed = ft.fit(folder, 2, resume="auto", init=9)
    for k, v in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


def _ids(prefix: Path) -> list[list[int]]:
    rows = []
    for path in sorted(prefix.parent.glob(prefix.name + "-rank*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


@pytest.mark.parametrize("new_world", [1, 3])
def test_resharded_resume_loads_the_saved_state_and_continues_at_the_same_sample(tmp_path, monkeypatch, new_world):
    folder = _stopped_run(tmp_path, "run", monkeypatch)
    before = [i for row in _ids(tmp_path / "run-ids") for i in row]
    assert len(before) == 12 and len(set(before)) == 12
    checkpoint = Checkpointer(folder).latest()
    from trainstack._checkpoint.sharded import tensors

    saved = tensors(checkpoint, "model")
    saved_optim = tensors(checkpoint, "optimizer")
    monkeypatch.setenv("FSDP_DUMP", str(tmp_path / "loaded.pt"))
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "after-ids"))
    model = ft.model(7)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                      ft.config(folder, new_world, resume="auto", max_iter=1,
                                callbacks=[Callback(on="train_start", callback=ft.dump_state_at_start)]),
                      loss_fn=ft.recording_loss)
    trainer.fit(ft.data())
    assert trainer.current_epoch == 1  # training finished the stopped epoch
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)
    for key, value in saved.items():
        assert torch.equal(loaded["model"][key], value), key
    flat = {f"state.{fqn}.{k}": v for fqn, st in loaded["optimizer"]["state"].items() for k, v in st.items()}
    for key, value in saved_optim.items():
        if key.startswith("state."):
            assert torch.equal(torch.as_tensor(flat[key]), value), key
    after = [i for row in _ids(tmp_path / "after-ids") for i in row]
    assert sorted(before + after) == list(range(ft.N_SAMPLES))  # the epoch: no sample skipped, none repeated
    assert len(Checkpointer(folder).checkpoints()) >= 2


def test_sigkill_during_a_sharded_save_keeps_the_previous_checkpoint(tmp_path):
    folder, marker = tmp_path / "run", tmp_path / "committing"
    env = {**os.environ, "FSDP_MARKER": str(marker), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(Path(ft.__file__)), str(folder), "2"], env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), "the run never reached its second commit"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
        gone = time.monotonic() + 20  # every killed worker gone (one still exiting holds the run folder's lock)
        while time.monotonic() < gone:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    checkpoints = Checkpointer(folder)
    assert [p.name for p in checkpoints.checkpoints()] == ["ckpt-e00001-s000000015"]
    assert list(checkpoints.folder.glob(".*tmp*"))  # the interrupted save stayed a temp folder
    plain = ft.model(5)
    restored = checkpoints.restore({"model": plain})  # loadable, in one process, into a plain module
    assert restored.counters["epoch"] == 1
    resumed = ft.fit(folder, 2, resume="auto", max_iter=4)  # the next run clears the leftover and finishes
    assert not list(checkpoints.folder.glob(".*tmp*")) and resumed is not None
    assert Checkpointer(folder).latest().name == "ckpt-e00004-s000000060"


def test_consolidate_inspect_and_the_final_export(tmp_path):
    fsdp = ft.fit(tmp_path / "run", 2, export_final_model="safetensors")  # gathered from both ranks' shards
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "run" / "export" / "model.safetensors"))
    assert exported.keys() == fsdp.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in fsdp.state_dict().items())
    out = tmp_path / "model.pt"
    result = CliRunner().invoke(main, ["checkpoint", "consolidate", str(tmp_path / "run"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    plain = ft.model(11)
    plain.load_state_dict(torch.load(out, weights_only=True))  # strict: the plain module's own keys
    for k, v in fsdp.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    info = CliRunner().invoke(main, ["checkpoint", "inspect", "--json", str(tmp_path / "run")])
    data = json.loads(info.output)
    assert (data["format"], data["world_size"], data["epoch"], data["step"]) == ("sharded", 2, 2, 30)
    bad = CliRunner().invoke(main, ["checkpoint", "inspect", str(tmp_path)])
    assert bad.exit_code == 1 and "no complete checkpoint" in bad.output


def test_async_sharded_checkpoints_commit_and_resume(tmp_path, monkeypatch):
    reference = ft.fit(tmp_path / "ref", 2, max_iter=3)
    run = ft.fit(tmp_path / "async", 2, max_iter=3, async_checkpoint=True)
    assert [p.name[:11] for p in Checkpointer(tmp_path / "async").checkpoints()] == [
        "ckpt-e00001", "ckpt-e00002", "ckpt-e00003"]
    for k, v in reference.state_dict().items():
        assert torch.equal(run.state_dict()[k], v), k


def test_clear_errors(tmp_path, capsys):
    m = ft.model()
    with pytest.raises(ConfigError, match="'NoSuchBlock'.*Its module classes are .*'Block'"):
        Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1),
                ft.config(tmp_path / "a", 2, fsdp_blocks=("NoSuchBlock",))).fit(ft.data())
    with pytest.raises(ConfigError, match="LBFGS"):
        Trainer(m, torch.optim.LBFGS(m.parameters()), ft.config(tmp_path / "b", 2))
    with pytest.raises(ConfigError, match="only apply with strategy='fsdp'"):
        TrainConfig(fsdp_blocks=("Block",))
    with pytest.raises(ConfigError, match="async_checkpoint=True needs sharded"):
        TrainConfig(async_checkpoint=True)
    one = ft.fit(tmp_path / "one", 1)  # fsdp on one process: trained whole, with a note
    assert "nothing to shard" in capsys.readouterr().out and one is not None
    assert Checkpointer(tmp_path / "one").latest().is_dir()
    wider = ft.model(0, width=32)
    with pytest.raises((CheckpointError, Exception), match="does not fit this run's model"):
        Trainer(wider, torch.optim.Adam(wider.parameters(), lr=0.01),
                ft.config(tmp_path / "one", 2, resume="auto", max_iter=3)).fit(ft.data())
    shutil.rmtree(tmp_path / "a", ignore_errors=True)

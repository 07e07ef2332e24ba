"""A run the job's driver shrank (a lost node, no spare left): continued on half the processes from the same
checkpoint, it keeps the global batch by gradient accumulation, takes the planned number of steps, and consumes every
sample of the epoch exactly once across the change; the same change from the same checkpoint is bitwise repeatable."""

from __future__ import annotations

import shutil

import _fsdp_train as ft
import pytest
import torch
from test_fsdp import _ids, _stopped_run

from trainstack import Trainer
from trainstack._train.shrink import keep_global_batch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _continue_on_one(folder, monkeypatch, ids):
    monkeypatch.setenv("TRAINSTACK_PLANNED_WORLD", "2")  # what the driver sets on a shrunk step
    monkeypatch.setenv("FSDP_IDS", str(ids))
    model = ft.model(7)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                      ft.config(folder, 1, "ddp", resume="auto", max_iter=1), loss_fn=ft.recording_loss)
    trainer.fit(ft.data())
    return trainer, model


def test_a_shrunk_run_keeps_the_global_batch_and_every_sample_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FSDP_STOP_STEP", "3")
    folder = _stopped_run(tmp_path, "run", monkeypatch)  # 2 ranks x batch 2, stopped at step 3 (12 samples)
    twin = tmp_path / "twin"
    shutil.copytree(folder, twin)
    before = [i for row in _ids(tmp_path / "run-ids") for i in row]
    trainer, model = _continue_on_one(folder, monkeypatch, tmp_path / "after-ids")
    said = capfd.readouterr().out
    assert "running on 1 of the 2 planned processes: gradient_accumulation_steps 1 -> 2" in said, said
    after = [i for row in _ids(tmp_path / "after-ids") for i in row]
    assert sorted(before + after) == list(range(ft.N_SAMPLES))  # every sample of the epoch once, across the change
    assert trainer.global_step == ft.N_SAMPLES // 4  # 4 samples per step before and after: the planned 15 steps
    _, again = _continue_on_one(twin, monkeypatch, tmp_path / "twin-ids")
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_the_global_batch_is_kept_only_where_it_can_be_and_said_otherwise():
    from trainstack import TrainConfig

    said: list[str] = []
    config = TrainConfig(compute_setup="cpu", gradient_accumulation_steps=3)
    assert keep_global_batch(config, 4, None, True, said.append) is config and not said  # not a shrunk step
    assert keep_global_batch(config, 2, "4", True, said.append).gradient_accumulation_steps == 6
    assert keep_global_batch(config, 3, "4", True, said.append) is config
    assert "4 processes do not divide by 3" in said[-1] and "an epoch takes more steps" in said[-1]
    assert keep_global_batch(config, 2, "4", False, said.append) is config
    assert "a custom optimize_step does not accumulate" in said[-1]
    assert keep_global_batch(config, 2, "four", True, said.append) is config and "'four'" in said[-1]

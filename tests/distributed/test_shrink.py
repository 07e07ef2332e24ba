"""A run the job's driver shrank (a lost node, no spare left): continued on half the processes from the same
checkpoint, it keeps the global batch by gradient accumulation, takes the planned number of steps, and consumes every
sample of the epoch exactly once across the change; the same change from the same checkpoint is bitwise repeatable."""

from __future__ import annotations

import shutil

import _fsdp_train as ft
import pytest
import torch
from test_fsdp import _ids, _stopped_run

from trainstack import Callback, Trainer
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


def test_a_move_to_a_larger_world_keeps_the_planned_global_batch_and_step_count(tmp_path, monkeypatch, capfd):
    """Issue 66 (UX review 4 defect 3): a run across clusters moved from 2 to 4 processes doubled the samples per
    optimizer step and ended early. Planned on 1 process accumulating 2 batches (4 samples a step), stopped at step
    3, continued on 2 processes (TRAINSTACK_PLANNED_WORLD=1): 1 batch each, still 4 samples a step, the planned 15
    steps, every sample of the epoch once."""
    from trainstack.errors import Preempted

    folder, stop = tmp_path / "run", tmp_path / "run.STOP"
    monkeypatch.setenv("FSDP_STOP", str(stop))
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "before-ids"))
    with pytest.raises(Preempted):
        ft.fit(folder, 1, "ddp", callbacks=[Callback(on="train_batch_end", callback=ft.touch_stop_at_step_3)],
               stop_file=stop, gradient_accumulation_steps=2, max_iter=1)
    stop.unlink()
    before = [i for row in _ids(tmp_path / "before-ids") for i in row]
    monkeypatch.setenv("TRAINSTACK_PLANNED_WORLD", "1")  # what the follower sets on the larger cluster
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / "after-ids"))
    model = ft.model(7)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                      ft.config(folder, 2, "ddp", resume="auto", max_iter=1, gradient_accumulation_steps=2),
                      loss_fn=ft.recording_loss)
    trainer.fit(ft.data())
    said = capfd.readouterr().out
    assert "running on 2 processes, 1 planned: gradient_accumulation_steps 2 -> 1" in said, said
    after = [i for row in _ids(tmp_path / "after-ids") for i in row]
    assert len(before) == 12 and sorted(before + after) == list(range(ft.N_SAMPLES))
    assert trainer.global_step == ft.N_SAMPLES // 4  # the planned 15 steps of 4 samples


def test_a_larger_world_whose_global_batch_cannot_be_kept_is_refused_with_the_fix():
    from trainstack import TrainConfig
    from trainstack.errors import ConfigError

    config = TrainConfig(gradient_accumulation_steps=1)
    with pytest.raises(ConfigError, match=r"planned on 2 processes .* runs on 4: its global batch would be 4/2 times .*"
                                          r"gradient_accumulation_steps a multiple of 2"):
        keep_global_batch(config, 4, "2", True, print)
    assert keep_global_batch(TrainConfig(gradient_accumulation_steps=6), 4, "2", True, print) \
        .gradient_accumulation_steps == 3

"""A shrink's restore on CUDA: a sharded checkpoint written by 2 processes (FSDP2 over gloo) continues on 1 process on
the GPU (FSDP2 over NCCL) -- the saved state loaded onto the device, the global batch kept by accumulation, every
sample of the epoch once across the change, and the same change from the same checkpoint bitwise repeatable."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import _fsdp_train as ft  # noqa: E402
from test_fsdp import _ids, _stopped_run  # noqa: E402

from trainstack import Callback, Trainer  # noqa: E402
from trainstack.checkpoint import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


def _continue_on_the_gpu(folder: Path, monkeypatch, tmp_path: Path, name: str) -> tuple[Trainer, dict]:
    monkeypatch.setenv("TRAINSTACK_PLANNED_WORLD", "2")  # what the driver sets on a shrunk step
    monkeypatch.setenv("FSDP_IDS", str(tmp_path / f"{name}-ids"))
    monkeypatch.setenv("FSDP_DUMP", str(tmp_path / f"{name}-loaded.pt"))
    devices: list[str] = []

    def at_end(trainer, config, writer) -> None:  # the whole state, gathered while the group is up
        devices.append(next(trainer.model.parameters()).device.type)
        os.environ["FSDP_DUMP"] = str(tmp_path / f"{name}-final.pt")
        ft.dump_state_at_start(trainer, config, writer)

    model = ft.model(7)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01),
                      ft.config(folder, 1, "fsdp", compute_setup="gpu", resume="auto", max_iter=1,
                                callbacks=[Callback(on="train_start", callback=ft.dump_state_at_start),
                                           Callback(on="train_end", callback=at_end)]),
                      loss_fn=ft.recording_loss)
    trainer.fit(ft.data())
    assert devices == ["cuda"]  # trained on the GPU
    return trainer, torch.load(tmp_path / f"{name}-final.pt", weights_only=False)["model"]


def test_a_cpu_sharded_checkpoint_continues_on_one_gpu_exactly(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("FSDP_STOP_STEP", "3")
    # this pytest process may have touched CUDA already (an earlier test): the CPU run's workers are spawned, not forked
    monkeypatch.setenv("TRAINSTACK_START_METHOD", "spawn")
    folder = _stopped_run(tmp_path, "run", monkeypatch)  # 2 ranks x batch 2 on the CPU, stopped at step 3
    twin = tmp_path / "twin"
    shutil.copytree(folder, twin)
    from trainstack._checkpoint.sharded import tensors

    saved = tensors(Checkpointer(folder).latest(), "model")
    before = [i for row in _ids(tmp_path / "run-ids") for i in row]
    trainer, weights = _continue_on_the_gpu(folder, monkeypatch, tmp_path, "after")
    said = capfd.readouterr().out
    assert "running on 1 of the 2 planned processes: gradient_accumulation_steps 1 -> 2" in said, said
    loaded = torch.load(tmp_path / "after-loaded.pt", weights_only=False)
    for key, value in saved.items():
        assert torch.equal(loaded["model"][key], value), key
    after = [i for row in _ids(tmp_path / "after-ids") for i in row]
    assert sorted(before + after) == list(range(ft.N_SAMPLES))  # every sample of the epoch once, across the change
    assert trainer.global_step == ft.N_SAMPLES // 4  # 4 samples per step before and after: the planned steps
    _, again = _continue_on_the_gpu(twin, monkeypatch, tmp_path, "twin")
    different = [k for k in weights if not torch.equal(again[k], weights[k])]
    assert not different, f"{different} differ between two identical shrinks on the GPU"

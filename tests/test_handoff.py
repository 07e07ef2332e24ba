"""The hand-off: rank 0's final state comes back into the launching process's own objects; a worker never receives
the launcher's run handles; a stopped run never reads as finished."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack._train import handoff
from trainstack.callbacks import CallbackManager
from trainstack.errors import Preempted, TrainingDiverged


def _trainer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    cfg = TrainConfig(max_iter=2, log_folder=tmp_path / "run", verbose=False, compute_setup="cpu")
    return Trainer(model, torch.optim.Adam(model.parameters(), lr=0.1), cfg)


def test_export_then_absorb_carries_the_trained_state(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit(DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4))
    result = handoff.export(trainer, {"seed": "None"})
    assert result is not None and result["epoch"] == 2 and result["global_step"] == 4
    assert all(not t.requires_grad and t.device.type == "cpu" for t in result["model"].values())
    fresh = _trainer(tmp_path / "b")
    identity = handoff.absorb(fresh, pickle.loads(pickle.dumps(result)), CallbackManager([], True))
    assert identity == {"seed": "None"}
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 4 and fresh.run_folder == trainer.run_folder


def test_a_worker_never_receives_the_launchers_run(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit(DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4))
    state = trainer.__getstate__()
    assert state["_run"] is None  # the last run's handles (folder lock, signal handlers, writers) stay here
    assert pickle.loads(pickle.dumps(trainer)).run is None  # nothing unpicklable travels


def test_a_stopped_run_raises_instead_of_returning(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.stop_reason = f"{handoff.PREEMPTED} (signal SIGUSR2)"
    with pytest.raises(Preempted, match="resume='auto'"):
        handoff.conclude(trainer)
    trainer.stop_reason = f"{handoff.DIVERGED}: the loss became nan"
    with pytest.raises(TrainingDiverged, match="the loss became nan"):
        handoff.conclude(trainer)

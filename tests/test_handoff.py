"""The hand-off: rank 0's final state comes back into the launching process's own objects; a worker never receives
the launcher's run handles; a stopped run never reads as finished."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack._train import handoff
from trainstack._train.progress import Progress, Stop
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
    assert result is not None and result["progress"]["epoch"] == 2 and result["progress"]["step"] == 4
    assert all(not t.requires_grad and t.device.type == "cpu" for t in result["model"].values())
    fresh = _trainer(tmp_path / "b")
    identity = handoff.absorb(fresh, pickle.loads(pickle.dumps(result)), CallbackManager([], True))
    assert identity == {"seed": "None"}
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[k], v)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 4 and fresh.run_folder == trainer.run_folder
    assert (fresh.current_epoch, fresh.global_step, fresh.global_batch) == (2, 4, 4) and not fresh.stop_training


def test_a_worker_never_receives_the_launchers_run(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit(DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4))
    state = trainer.__getstate__()
    assert state["_run"] is None  # the last run's handles (folder lock, signal handlers, writers) stay here
    assert pickle.loads(pickle.dumps(trainer)).run is None  # nothing unpicklable travels


def test_a_stopped_run_raises_instead_of_returning(tmp_path):
    trainer = _trainer(tmp_path)
    handoff.conclude(trainer)  # no stop: the run finished, fit() returns
    trainer.progress.ask(Stop.PREEMPTED, "preempted (signal SIGUSR2)")
    with pytest.raises(Preempted, match=r"preempted \(signal SIGUSR2\).*resume='auto'"):
        handoff.conclude(trainer)
    trainer.progress.ask(Stop.DIVERGED, "the loss became nan")  # the reason; the kind is the stop's own field
    assert trainer.stop_reason == "diverged: the loss became nan"
    with pytest.raises(TrainingDiverged, match="^trainstack: the loss became nan$"):
        handoff.conclude(trainer)
    trainer.progress.ask(Stop.MAX_STEPS, "max_steps=3 reached")
    handoff.conclude(trainer)  # the step limit finishes a run


def test_the_progress_travels_whole_and_only_a_requested_stop_is_recorded():
    progress = Progress(2, 17, 34, Stop.PREEMPTED, "preempted (signal SIGTERM)")
    again = Progress.from_state(pickle.loads(pickle.dumps(progress.state_dict())))
    assert again == progress and not again.finished and again.stopped_by() is None
    again.ask(Stop.REQUESTED, "EarlyStopping: val_loss did not improve", unless_stopping=True)
    assert again.why.startswith("preempted")  # the first stop keeps its reason
    again.resume()
    again.ask(Stop.REQUESTED, "EarlyStopping: val_loss did not improve")
    assert again.finished and again.stopped_by() == "EarlyStopping: val_loss did not improve"

"""A `Run` opened on one gloo process without the loop: what one fit() holds (the run folder claimed, the
checkpointer, the schedule from the config, the span), what its checkpoints record and restore, that it is released
on close -- also when opening fails half-way -- and that it never crosses processes."""

from __future__ import annotations

import pickle
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import TrainConfig, Trainer
from trainstack._train.run import Run
from trainstack._train.runfolder import Claim, RunLock
from trainstack._train.schedule import Schedule
from trainstack.checkpoint import CheckpointError


def _trainer(tmp_path, **config) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    cfg = TrainConfig(max_iter=3, log_folder=tmp_path / "run", verbose=False, compute_setup="cpu", backend="gloo",
                      **config)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg,
                   train_dataloader=DataLoader(data, batch_size=8))


def _open(trainer: Trainer, fired: list | None = None) -> Run:
    def parts(run):
        return {"model": trainer.model, "optimizer": trainer.optimizer}

    return Run.open(trainer, Claim(), fire=lambda *event: (fired if fired is not None else []).append(event),
                    parts=parts)


def test_a_run_holds_one_fit_and_releases_it(tmp_path):
    trainer = _trainer(tmp_path, checkpoint_every=2, val_every_n_steps=0, max_steps=12)
    before = signal.getsignal(signal.SIGUSR2)
    run = _open(trainer)
    try:
        assert run.running and run.path == tmp_path / "run" and RunLock.held(run.path)
        assert run.model is trainer.model  # one process: no wrapper
        assert run.per_epoch == 5 and run.last_epoch == 3 and run.last_step == 12
        span = run.span(1)
        assert (span.total_steps, span.steps_per_epoch) == (12, 5)  # max_steps caps the 15 steps of 3 epochs
        assert run.schedule.due_at_epoch_end(2, 10) == {"checkpoint"} and not run.schedule.validates
        assert signal.getsignal(signal.SIGUSR2) != before  # the graceful stop listens while the run is open
        counters = run.counters()
        assert counters["epoch"] == 0 and counters["identity"]["optimizer"] == "SGD" and counters["run_id"]
        trainer.global_step, trainer.current_epoch = 7, 1
        saved = run.checkpointer.save(run.counters(), run.parts())
        assert saved is not None and saved.exists()
    finally:
        run.close()
    assert not run.running and not RunLock.held(run.path)
    assert signal.getsignal(signal.SIGUSR2) == before


def test_a_new_run_on_the_folder_resumes_its_counters(tmp_path):
    first = _trainer(tmp_path)
    run = _open(first)
    first.global_step, first.current_epoch = 10, 2
    run.checkpointer.save(run.counters(), run.parts())
    run.close()
    second = _trainer(tmp_path, resume="auto")
    again = _open(second)
    try:
        assert (second.global_step, second.current_epoch) == (10, 2) and again.run_id == run.run_id
        assert again.last_epoch == 3 and again.first_step == 10  # max_iter counts from where the run started
        assert torch.equal(second.model.weight, first.model.weight)
    finally:
        again.close()


def test_a_failure_while_opening_releases_what_was_taken(tmp_path):
    trainer = _trainer(tmp_path, resume=str(tmp_path / "no-such.pt"))
    before = signal.getsignal(signal.SIGUSR2)
    with pytest.raises(CheckpointError, match="no-such.pt"):
        _open(trainer)
    assert not RunLock.held(tmp_path / "run") and signal.getsignal(signal.SIGUSR2) == before


def test_a_run_never_crosses_processes_and_the_trainer_leaves_it_behind(tmp_path):
    trainer = _trainer(tmp_path)
    run = _open(trainer)
    try:
        with pytest.raises(TypeError, match="never crosses processes"):
            pickle.dumps(run)
    finally:
        run.close()
    trainer.fit()  # its own run, opened and closed inside
    assert trainer.run is None  # outside fit(): no run
    assert "_run" not in pickle.loads(pickle.dumps(trainer)).__dict__ or \
        pickle.loads(pickle.dumps(trainer)).run is None


def test_the_schedule_is_the_one_reader_of_the_cadence():
    cfg = TrainConfig(val_every=2, checkpoint_every_n_steps=4, log_every_n_steps=0, verbose=False)
    schedule = Schedule.of_run(cfg, {"log": 0, "bar": 0, "clock": 0}, validates=True)
    assert schedule.periods == {"poll": cfg.stop_check_every, "checkpoint": 4}
    assert schedule.due_at_epoch_end(2, 5) == {"val"} and schedule.due_at_epoch_end(3, 8) == {"checkpoint"}
    assert Schedule.of_run(cfg, {}, validates=False).due_at_epoch_end(2, 8) == {"checkpoint"}
    best = TrainConfig(val_every=1, checkpoint_best_only=True, checkpoint_every=1, verbose=False)
    only_best = Schedule.of_run(best, {}, validates=True)
    assert not only_best.periodic_checkpoints and only_best.due_at_epoch_end(1, 1) == {"val"}

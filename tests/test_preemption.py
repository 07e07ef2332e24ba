"""Graceful stop in one process: a signal or a stop file mid-epoch -> checkpoint -> Preempted -> exact resume."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack._runtime.preemption import resolve_signals
from trainstack.checkpoint import Checkpointer
from trainstack.errors import ConfigError, Preempted


def _fit(tmp_path, folder, callbacks=(), resume=None, stop_file=None, init_seed=0, accum=1):
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(48, 3, generator=g), torch.randn(48, 1, generator=g)), batch_size=4,
                      shuffle=True)
    cfg = TrainConfig(max_iter=4, log_folder=tmp_path / folder, verbose=False, seed=5, stop_check_every=1,
                      callbacks=list(callbacks), resume=resume, stop_file=stop_file, gradient_accumulation_steps=accum)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg)
    trainer.fit(data)
    return trainer


def _at_batch(batch, action):
    def cb(trainer, config, writer):
        if trainer.global_batch == batch:
            action()
    return Callback(on="train_batch_end", callback=cb)


@pytest.mark.parametrize("how", ["signal", "stop_file"])
def test_mid_epoch_stop_then_resume_is_bitwise_identical(tmp_path, how, capsys):
    reference = _fit(tmp_path, "ref").model.state_dict()
    stop_file = tmp_path / "STOP"
    action = (lambda: os.kill(os.getpid(), signal.SIGUSR2)) if how == "signal" else stop_file.touch
    ended = []
    on_end = Callback(on="train_end", callback=lambda t, c, w: ended.append(t.current_epoch))
    with pytest.raises(Preempted) as exc:
        _fit(tmp_path, "run", callbacks=[_at_batch(17, action), on_end], stop_file=stop_file)  # epoch 2, batch 5
    assert exc.value.code == 0 and "resume='auto'" in str(exc.value)
    assert ended == []  # the run was stopped, not finished: train_end callbacks do not fire
    assert "Graceful stop at epoch 1, step 17" in capsys.readouterr().out
    state = torch.load(Checkpointer(tmp_path / "run").latest(), weights_only=True)
    assert state["global_step"] == 17 and state["partial_epoch"]["batch_in_epoch"] == 5
    stop_file.unlink(missing_ok=True)
    resumed = _fit(tmp_path, "run", resume="auto", init_seed=9)
    assert resumed.current_epoch == 4 and resumed.global_step == 48
    for k, v in reference.items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # handler restored after fit


def test_stop_waits_for_the_end_of_an_accumulation_window(tmp_path):
    stop_file = tmp_path / "STOP"
    with pytest.raises(Preempted):
        _fit(tmp_path, "acc", callbacks=[_at_batch(5, stop_file.touch)], stop_file=stop_file, accum=4)
    state = torch.load(Checkpointer(tmp_path / "acc").latest(), weights_only=True)
    # not after batch 5: the optimizer step of the window 5..8 is never half done (step 2 = batches 1..8)
    assert (state["global_batch"], state["global_step"]) == (8, 2)


def test_stop_at_an_epoch_end_saves_and_stops(tmp_path):
    stop_file = tmp_path / "STOP"
    cb = Callback(on="train_epoch_end", callback=lambda t, c, w: stop_file.touch() if t.current_epoch == 2 else None)
    with pytest.raises(Preempted):
        _fit(tmp_path, "ep", callbacks=[cb], stop_file=stop_file)
    state = torch.load(Checkpointer(tmp_path / "ep").latest(), weights_only=True)
    assert state["epoch"] == 2 and state["partial_epoch"]["batch_in_epoch"] == 0


def test_signal_names_are_validated_and_env_default():
    assert resolve_signals(None, {}) == (signal.SIGUSR2,)
    assert resolve_signals(None, {"TRAINSTACK_STOP_SIGNALS": "USR1,SIGTERM"}) == (signal.SIGUSR1, signal.SIGTERM)
    with pytest.raises(ConfigError, match="SIGFOO"):
        TrainConfig(stop_signals=("SIGFOO",))

"""Callbacks without a Trainer: firing rules, rank-0-only ones, the hot-loop period, state round trips."""

from __future__ import annotations

import pytest

from trainstack.callbacks import (
    Callback,
    CallbackManager,
    EarlyStopping,
    LRSchedulerCosineAnnealing,
    OptimizeResult,
    PrintMetrics,
    SaveBestCheckpoint,
)
from trainstack.errors import ConfigError


class _Host:
    """The little a callback reads off a trainer."""

    def __init__(self, iteration=0, metrics=None):
        self.opt_result = OptimizeResult(iteration, None, None, metrics=metrics or {})
        self.config = None
        self.writer = None
        self.stopped = None
        self.printed = []

    def request_stop(self, reason):
        self.stopped = reason

    def console_print(self, text):
        self.printed.append(text)


def test_firing_rules_follow_qadence():
    seen = []
    cb = Callback(on="train_epoch_end", called_every=2, callback=lambda t, c, w: seen.append(t.opt_result.iteration),
                  callback_condition=lambda res: res.iteration != 4)
    for it in range(7):
        cb("train_epoch_end", _Host(it), None, None)
    cb("train_batch_end", _Host(2), None, None)  # another event: ignored
    assert seen == [2, 6]  # 0 never fires, 4 fails the condition
    always = []
    Callback(on="train_start", called_every=0, callback=lambda t, c, w: always.append(1))("train_start", _Host(0),
                                                                                           None, None)
    assert always == [1]


def test_manager_keeps_rank0_only_callbacks_off_other_ranks_and_gates_periods():
    cbs = [PrintMetrics(on="train_epoch_end"), Callback(on="train_batch_end", called_every=4, callback=print),
           Callback(on="train_batch_end", called_every=6, callback=print),
           Callback(on="train_batch_start", called_every=0, callback=print)]
    assert len(CallbackManager(cbs, is_main=False).callbacks) == 3
    manager = CallbackManager(cbs, is_main=True)
    assert manager.period("train_batch_end") == 2 and manager.period("train_batch_start") == 0
    assert manager.period("val_batch_end") == 0


def test_state_round_trip_and_a_changed_callback_set_is_not_misassigned():
    stopper = EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=2)
    best = SaveBestCheckpoint()
    manager = CallbackManager([stopper, best], True)
    stopper.best, stopper.wait, best.best_val_loss = 0.5, 1, 0.25
    state = manager.state_dict()
    fresh = CallbackManager([EarlyStopping(monitor="train_loss"), SaveBestCheckpoint()], True)
    fresh.load_state_dict(state)
    assert (fresh.callbacks[0].best, fresh.callbacks[0].wait, fresh.callbacks[1].best_val_loss) == (0.5, 1, 0.25)
    other = CallbackManager([EarlyStopping(monitor="train_loss")], True)
    other.load_state_dict(state)  # two saved states for one callback: kept fresh rather than guessed
    assert other.callbacks[0].wait == 0


def test_early_stopping_requests_a_stop_after_patience():
    stopper = EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=2)
    host = _Host(1, {"train_loss": 1.0})
    for it, loss in enumerate([1.0, 1.1, 1.2], 1):
        host.opt_result.iteration, host.opt_result.metrics = it, {"train_loss": loss}
        stopper("train_epoch_end", host, None, None)
    assert "did not improve for 2" in host.stopped
    with pytest.raises(ConfigError, match="'val_loss' not found"):
        EarlyStopping()("val_epoch_end", _Host(1, {"train_loss": 1.0}), None, None)


def test_print_metrics_formats_one_line():
    host = _Host(3, {"train_loss": 0.5, "val_acc": 0.00001})
    PrintMetrics(on="train_epoch_end")("train_epoch_end", host, None, None)
    assert host.printed == ["epoch 3 | train_loss 0.5 | val_acc 1.000e-05"]  # the live line's format


def test_cosine_annealing_state_is_kept():
    cb = LRSchedulerCosineAnnealing(t_max=10, min_lr=0.0)
    assert cb.new_lr(1.0, 5) == pytest.approx(0.5)
    again = LRSchedulerCosineAnnealing(t_max=10)
    again.load_state_dict(cb.state_dict())
    assert again.new_lr(0.1, 5) == pytest.approx(0.5)  # the max lr survived, not the current one

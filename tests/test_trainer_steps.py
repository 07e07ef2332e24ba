"""The Trainer's step-based layer in one process: max_steps, schedules by step, live lines, trainer.log, schedulers
that count optimizer steps, predict, a graceful Ctrl-C, the run folder's config (2 processes: tests/distributed)."""

from __future__ import annotations

import json
import os
import signal
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.callbacks import EarlyStopping, LRScheduler
from trainstack.checkpoint import Checkpointer
from trainstack.errors import ConfigError, Interrupted


def _loader(n=40, batch=4, shuffle=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch, shuffle=shuffle)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))


def _fit(tmp_path, name="run", loader=None, val=None, optimizer=None, **kw):
    model = _model(kw.pop("init_seed", 0))
    opt = (optimizer or (lambda p: torch.optim.Adam(p, lr=0.01)))(model.parameters())
    scheduler = kw.pop("scheduler", None)
    interval = kw.pop("scheduler_interval", "epoch")
    cfg = TrainConfig(**({"max_iter": 3, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "cpu",
                          "seed": 4} | kw))
    trainer = Trainer(model, opt, cfg, scheduler=scheduler(opt) if scheduler else None, scheduler_interval=interval)
    trainer.fit(loader or _loader(), val)
    return trainer


def _rows(trainer):
    return [json.loads(line) for line in (trainer.run_folder / "metrics.jsonl").read_text().splitlines()]


def _equal(a, b):
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k


# ---------------------------------------------------------------------------------------------- max_steps
def test_max_steps_counts_optimizer_steps_with_accumulation_and_a_resume_continues_exactly(tmp_path):
    trainer = _fit(tmp_path, max_iter=100, max_steps=7, gradient_accumulation_steps=3)  # 10 batches: 4 steps/epoch
    adam = trainer.optimizer.state_dict()["state"][0]["step"]
    assert int(adam) == 7 and trainer.global_step == 7 and trainer.current_epoch == 1
    assert trainer.global_batch == 10 + 9 and trainer.stop_reason == "max_steps=7 reached"
    state = torch.load(Checkpointer(trainer.run_folder).latest(), weights_only=True)
    assert (state["global_step"], state["global_batch"], state["partial_epoch"]["batch_in_epoch"]) == (7, 19, 9)
    # a longer run from the start equals this one continued with a higher limit
    reference = _fit(tmp_path, "ref", max_iter=100, max_steps=11, gradient_accumulation_steps=3)
    resumed = _fit(tmp_path, max_iter=100, max_steps=11, gradient_accumulation_steps=3, resume="auto", init_seed=9)
    assert resumed.global_step == 11 and int(resumed.optimizer.state_dict()["state"][0]["step"]) == 11
    _equal(reference, resumed)


def test_max_steps_at_an_epoch_end_finishes_the_epoch_and_max_iter_still_bounds(tmp_path):
    ended = []
    at_end = Callback(on="train_epoch_end", callback=lambda t, c, w: ended.append(t.current_epoch))
    trainer = _fit(tmp_path, max_iter=100, max_steps=20, callbacks=[at_end])  # 10 steps per epoch
    final = torch.load(Checkpointer(trainer.run_folder).latest(), weights_only=True)  # at the epoch's end
    assert trainer.global_step == 20 and ended == [1, 2] and final["partial_epoch"]["batch_in_epoch"] == 0
    assert _fit(tmp_path, "short", max_iter=1, max_steps=1000).global_step == 10
    with pytest.raises(ConfigError, match="max_steps=0"):
        TrainConfig(max_steps=0)


def test_a_run_that_reached_max_steps_says_there_is_nothing_to_train(tmp_path, capsys):
    _fit(tmp_path, max_steps=5)
    _fit(tmp_path, max_steps=5, resume="auto", verbose=True)
    assert "NOTHING TO TRAIN" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- by step
def test_validation_and_checkpoints_every_n_steps_mid_epoch_and_a_crash_resumes_bitwise(tmp_path):
    def crash(trainer, config, writer):
        if trainer.global_step == 17 and not (tmp_path / "crashed").exists():
            (tmp_path / "crashed").touch()
            raise RuntimeError("simulated crash")

    kw = dict(max_iter=3, val_every_n_steps=4, checkpoint_every_n_steps=6, val=_loader(12, 4, shuffle=False, seed=1))
    reference = _fit(tmp_path, "ref", **kw)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, "run", callbacks=[Callback(on="optimizer_step", callback=crash)], **kw)
    ckpts = [p.name for p in Checkpointer(tmp_path / "run").checkpoints()]
    assert ckpts == ["ckpt-e00000-s000000006.pt", "ckpt-e00001-s000000012.pt"], ckpts  # mid-epoch, by step
    resumed = _fit(tmp_path, "run", resume="auto", init_seed=5, callbacks=[Callback(on="optimizer_step",
                                                                                   callback=crash)], **kw)
    _equal(reference, resumed)
    val_rows = lambda t: [(r["step"], r["val_loss"]) for r in _rows(t) if "val_loss" in r]  # noqa: E731
    assert [s for s, _ in val_rows(reference)] == [4, 8, 12, 16, 20, 24, 28]  # the step-30 one? 30 % 4 != 0
    assert val_rows(resumed) == val_rows(reference)  # the stopped run's rows after step 12 were dropped


def test_early_stopping_after_a_mid_epoch_validation_stops_there_with_a_checkpoint(tmp_path):
    stopper = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # never "improves" after the first
    trainer = _fit(tmp_path, max_iter=50, val_every_n_steps=3, callbacks=[stopper],
                   val=_loader(12, 4, shuffle=False, seed=1))
    assert trainer.global_step == 6 and "EarlyStopping" in trainer.stop_reason
    state = torch.load(Checkpointer(trainer.run_folder).latest(), weights_only=True)
    assert state["global_step"] == 6 and state["partial_epoch"]["batch_in_epoch"] == 6


# ---------------------------------------------------------------------------------------------- live lines, log
def test_without_a_terminal_a_line_every_n_steps_and_at_the_end_a_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINSTACK_PROGRESS", "0")
    trainer = _fit(tmp_path, verbose=True, log_every_n_steps=4, log_every_seconds=0, max_iter=2)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("epoch ") and "| loss " in line]
    assert [line.split(" | ")[1] for line in lines] == [f"step {s}/20" for s in (4, 8, 12, 16, 20)], lines
    assert all(" | lr 1.00e-02 | " in line and "samples/s" in line for line in lines)
    assert "Training finished: 2 epoch(s), 20 step(s)" in out and f"run folder: {trainer.run_folder}" in out
    rows = [r for r in _rows(trainer) if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 12, 16, 20] and rows[0]["epoch"] == 0.4 and "iteration" not in rows[0]
    assert (trainer.run_folder / "config.yaml").is_file()
    assert TrainConfig.from_file(trainer.run_folder / "config.yaml").log_every_n_steps == 4


def test_a_slow_run_gets_time_based_lines_between_step_lines(tmp_path, capsys, monkeypatch):
    import time

    monkeypatch.setenv("TRAINSTACK_PROGRESS", "0")
    slow = Callback(on="train_batch_end", callback=lambda t, c, w: time.sleep(0.06))
    _fit(tmp_path, verbose=True, log_every_n_steps=1000, log_every_seconds=0.25, max_iter=1, callbacks=[slow])
    lines = [line for line in capsys.readouterr().out.splitlines() if "| loss " in line]
    assert 1 <= len(lines) <= 4, lines  # 10 steps of ~0.06 s: a line every ~0.25 s, none per step


def test_lines_take_one_host_sync_each_not_one_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTACK_PROGRESS", "0")
    conversions = {"n": 0}
    original = torch.Tensor.__float__

    def counting(self):
        conversions["n"] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__float__", counting)
    _fit(tmp_path, log_every_n_steps=25, log_every_seconds=0, max_iter=10, loader=_loader(200, 4))  # 500 steps
    assert conversions["n"] < 80, conversions  # 20 lines (+10 epoch rows) of a couple of values, not 500


def test_trainer_log_reaches_the_line_the_rows_and_the_learning_rates_of_every_group(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINSTACK_PROGRESS", "0")

    def log(trainer, config, writer):
        trainer.log("grad_norm", torch.tensor(float(trainer.global_step)))
        trainer.log({"calls": 1.0}, reduce="sum")

    def two_groups(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.001}], lr=0.1)

    trainer = _fit(tmp_path, verbose=True, log_every_n_steps=5, log_every_seconds=0, max_iter=1, optimizer=two_groups,
                   callbacks=[Callback(on="optimizer_step", callback=log)])
    rows = [r for r in _rows(trainer) if "loss" in r]
    assert [(r["grad_norm"], r["calls"]) for r in rows] == [(3.0, 5.0), (8.0, 5.0)]  # means of 1..5, 6..10
    assert rows[0]["lr/group0"] == 0.1 and rows[0]["lr/group1"] == 0.001
    assert "grad_norm 3 | calls 5" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- schedulers
def test_a_step_scheduler_steps_once_per_optimizer_step_and_never_warns(tmp_path):
    counts = []

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: counts.append(step) or 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "scheduler before optimizer" / "overridden" warnings fail
        trainer = _fit(tmp_path, max_iter=2, gradient_accumulation_steps=3, scheduler=scheduler,
                       scheduler_interval="step")
    assert trainer.global_step == 8 and trainer.scheduler.scheduler.last_epoch == 8  # 10 batches: 4 steps/epoch
    with pytest.raises(ConfigError, match="scheduler_interval='batch'"):
        Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), TrainConfig(), scheduler_interval="batch")


def test_a_batch_end_scheduler_with_accumulation_steps_only_after_optimizer_steps(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cfg = TrainConfig(max_iter=1, log_folder=tmp_path / "b", verbose=False, gradient_accumulation_steps=4,
                      callbacks=[LRScheduler(sched, on="train_batch_end")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(model, opt, cfg).fit(_loader())  # 10 batches: windows of 4, 4, 2
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)


# ---------------------------------------------------------------------------------------------- predict
def test_predict_returns_every_sample_in_dataset_order_even_from_a_shuffled_loader(tmp_path):
    trainer = _fit(tmp_path, max_iter=1)
    data = _loader(11, 3, shuffle=True)
    x = data.dataset.tensors[0]
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(x)
    out = trainer.predict(data)
    assert torch.allclose(out, expected) and out.shape == (11, 1)
    pair = trainer.predict(data, predict_fn=lambda model, batch: {"y": model(batch[0]), "x": batch[0]})
    assert torch.equal(pair["x"], x) and torch.allclose(pair["y"], expected)
    with pytest.raises(ConfigError, match="one row per sample"):
        trainer.predict(data, predict_fn=lambda model, batch: model(batch[0]).sum())


# ---------------------------------------------------------------------------------------------- Ctrl-C
def test_a_first_ctrl_c_stops_with_a_checkpoint_and_a_resume_equals_an_uninterrupted_run(tmp_path, capsys):
    def interrupt(trainer, config, writer):
        if trainer.global_step == 13 and not (tmp_path / "interrupted").exists():
            (tmp_path / "interrupted").touch()
            os.kill(os.getpid(), signal.SIGINT)

    reference = _fit(tmp_path, "ref", max_iter=3, stop_check_every=1)
    with pytest.raises(Interrupted) as exc:
        _fit(tmp_path, "run", max_iter=3, stop_check_every=1, verbose=True,
             callbacks=[Callback(on="optimizer_step", callback=interrupt)])
    assert exc.value.code == 130 and "resume='auto'" in str(exc.value)
    out = capsys.readouterr()
    assert "Interrupted at epoch 1, step 13 (Ctrl-C)" in out.out and "Ctrl-C again to abort" in out.err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after fit
    resumed = _fit(tmp_path, "run", max_iter=3, stop_check_every=1, resume="auto", init_seed=3)
    _equal(reference, resumed)


def test_a_second_ctrl_c_aborts(tmp_path):
    def twice(trainer, config, writer):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path, stop_check_every=50, callbacks=[Callback(on="optimizer_step", callback=twice)])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

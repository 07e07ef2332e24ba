"""What rank 0 shows while training: live lines from the epoch's sums, learning rates, the summary."""

from __future__ import annotations

import warnings

import torch

from trainstack._train.live import LiveLog, format_line, hold_warnings, learning_rates, summary
from trainstack._train.metrics import EpochSums


def test_a_live_line_averages_the_steps_since_the_previous_one():
    live = LiveLog(samples_per_batch=8, world_size=2, accumulation=1)
    sums = EpochSums()
    live.epoch_start(sums, 0)
    for v in (1.0, 3.0):
        sums.add(torch.tensor(v), {"acc": torch.tensor(v / 10)})
    first = live.values(sums, 2, 2, None)
    assert first["loss"] == 2.0 and abs(first["acc"] - 0.2) < 1e-6 and first["samples_per_s"] > 0
    for v in (5.0, 7.0, 9.0):
        sums.add(torch.tensor(v), {"acc": torch.tensor(0.0)})
    second = live.values(sums, 5, 5, None)
    assert second["loss"] == 7.0 and second["acc"] == 0.0  # only the 3 new steps
    fresh = EpochSums()  # a new epoch: its sums start from zero
    fresh.add(torch.tensor(4.0), {})
    assert live.values(fresh, 1, 6, None)["loss"] == 4.0


def test_learning_rates_per_param_group_and_the_line_format():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    one = torch.optim.SGD(a.parameters(), lr=0.1)
    two = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.01}], lr=0.1)
    assert learning_rates(one) == {"lr": 0.1} and learning_rates(two) == {"lr/group0": 0.1, "lr/group1": 0.01}
    assert learning_rates(None) == {}
    line = format_line("epoch 1/3 | step 5", {"loss": 0.123456, "lr": 0.001, "samples_per_s": 1234.5})
    assert line == "epoch 1/3 | step 5 | loss 0.1235 | lr 1.00e-03 | 1,234 samples/s"


def test_the_summary_names_time_steps_best_and_folder():
    text = summary(75.0, (3, 120), (0, 0), {"name": "val_acc", "value": 0.91, "epoch": 2, "step": 80,
                                   "path": "/r/checkpoints/best.pt"}, "/r", "max_steps=120 reached")
    assert "3 epoch(s), 120 step(s) in 00:01:15 (1.60 steps/s); max_steps=120 reached" in text
    assert "best val_acc = 0.91 (step 80): /r/checkpoints/best.pt" in text and "run folder: /r" in text


def test_a_resumed_run_says_where_it_ended_and_what_it_trained_itself():
    text = summary(2.0, (4, 16), (2, 8), None, "/r", "")
    assert "Training finished: at epoch 4, step 16 (2 epoch(s), 8 step(s) this run) in 2.0 s (4.00 steps/s)." in text


def test_other_ranks_hold_their_warnings_until_the_bar_is_gone(capsys):
    release = hold_warnings(1)
    for _ in range(3):
        warnings.warn("lr scheduler called too early", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == ""
    release()
    err = capsys.readouterr().err
    assert err.count("[rank 1] warning during training: UserWarning: lr scheduler called too early") == 1


def test_lines_after_a_resume_count_only_this_runs_steps_and_epochs_are_finished_passes(tmp_path, capsys,
                                                                                         monkeypatch):
    """The first line after a resume used to divide the steps before the resume by this run's seconds (10,339
    samples/s); epochs are finished passes in the line as in checkpoint names; the summary shows the final loss.
    The lines' clock ticks one second per reading: a loaded machine's real seconds would make the rates noise."""
    import itertools
    import re
    import time
    import types

    from torch.utils.data import DataLoader, TensorDataset

    from trainstack import TrainConfig, Trainer
    from trainstack._train import live

    ticks = itertools.count()
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.monotonic = lambda: float(next(ticks))
    monkeypatch.setattr(live, "time", clock)

    def run(max_steps):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        loader = DataLoader(TensorDataset(torch.randn(64, 3), torch.randn(64, 1)), batch_size=8)
        cfg = TrainConfig(max_steps=max_steps, max_iter=100, log_every_n_steps=4, checkpoint_every_n_steps=20,
                          resume="auto", log_folder=tmp_path / "run", compute_setup="cpu", log_every_seconds=0)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg).fit(loader)
        return capsys.readouterr().out

    run(20)
    out = run(60)
    rates = [float(r.replace(",", "")) for r in re.findall(r"\| ([\d,.]+) samples/s", out)]
    assert len(rates) >= 5 and rates[0] <= max(rates[1:]), rates  # the bug: 6x (24 steps, not this run's 4)
    assert "epoch 3 | step 24/60" in out and "epoch 3.5 | step 28/60" in out, out
    assert re.search(r"final: train_loss [\d.]+", out), out

"""Trainer in one process: call counts, callbacks, metrics, checkpoints, exact resume, seeding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.callbacks import EarlyStopping, LRScheduler
from trainstack.checkpoint import Checkpointer, CheckpointError
from trainstack.errors import ConfigError, TrainingDiverged


def _loader(n=32, batch=8, shuffle=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=batch, shuffle=shuffle)


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))


def _config(tmp_path, **kw):
    base = dict(max_iter=3, log_folder=tmp_path / "run", verbose=False, compute_setup="cpu")
    return TrainConfig(**(base | kw))


class CountingLoss:
    def __init__(self):
        self.calls = 0
        self.none_batches = 0

    def __call__(self, model, batch):
        self.calls += 1
        if batch is None:
            self.none_batches += 1
            return model[0].weight.pow(2).sum()
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"mae": (model(x) - y).abs().mean()}


def test_max_iter_is_exactly_that_many_passes(tmp_path):
    loss = CountingLoss()
    trainer = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), _config(tmp_path), loss_fn=loss)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    trainer.fit(_loader())
    assert loss.calls == 3 * 4 and trainer.current_epoch == 3 and trainer.global_step == 12


def test_validation_calls_and_metric_prefixes(tmp_path):
    loss = CountingLoss()
    model = _model()
    cfg = _config(tmp_path, max_iter=5, val_every=2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=loss,
                      val_dataloader=_loader(16, 8))
    trainer.fit(_loader())
    assert loss.calls == 5 * 4 + 2 * 2  # validation after epochs 2 and 4, 2 batches each
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert set(rows[1]) == {"epoch", "iteration", "step", "time", "train_loss", "train_mae", "val_loss", "val_mae"}
    assert "val_loss" not in rows[0]


def test_no_data_calls_loss_once_per_iteration(tmp_path):
    loss = CountingLoss()
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path, max_iter=4), loss_fn=loss).fit()
    assert loss.calls == loss.none_batches == 4


def test_callback_firing_rules(tmp_path):
    seen = []

    def rec(name):
        return lambda trainer, config, writer: seen.append((name, trainer.opt_result.iteration))

    cbs = [Callback(on="train_start", callback=rec("start")), Callback(on="train_end", callback=rec("end")),
           Callback(on="train_epoch_end", called_every=2, callback=rec("epoch")),
           Callback(on="train_batch_end", called_every=3, callback=rec("batch")),
           Callback(on="train_epoch_end", called_every=1, callback=rec("cond"),
                    callback_condition=lambda res: res.iteration == 5),
           Callback(on="train_epoch_end", called_every=0, callback=rec("never")),
           Callback(on="train_epoch_start", callback=rec("epoch_start"), modify_optimize_result={"tag": 1})]
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path, max_iter=5, callbacks=cbs))
    trainer.fit(_loader(16, 8))  # 2 batches per epoch, 10 global steps
    assert seen[0] == ("start", 0) and seen[-1] == ("end", 5)
    assert [it for n, it in seen if n == "epoch"] == [2, 4]
    assert [it for n, it in seen if n == "batch"] == [3, 6, 9]
    assert [it for n, it in seen if n == "cond"] == [5]
    assert not [s for s in seen if s[0] == "never"]
    assert [it for n, it in seen if n == "epoch_start"] == [1, 2, 3, 4]  # iteration 0 is skipped, as qadence
    assert trainer.opt_result.extra == {"tag": 1}


def test_bad_callback_arguments():
    with pytest.raises(ConfigError, match="on='idle'"):
        Callback(on="idle")
    with pytest.raises(ConfigError, match="called_every=-1"):
        Callback(called_every=-1)
    with pytest.raises(ConfigError, match="mode='median'"):
        EarlyStopping(mode="median")


def test_print_metrics_from_the_main_process(tmp_path, capsys):
    model = _model()
    cfg = _config(tmp_path, max_iter=4, print_every=2, verbose=True)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader())
    out = capsys.readouterr().out
    assert "***** Running training *****" in out and "Total optimization steps" in out
    assert re.search(r"Parallelism += +ddp: 1 replica\(s\)", out), out  # the mesh said (HSDP/TP/AC too)
    lines = [line for line in out.splitlines() if line.startswith("epoch ") and "train_loss " in line]
    assert len(lines) == 2 and lines[0].startswith("epoch 2/4 | step 8 |") and "train_mse " in lines[0], lines


def test_the_banner_totals_the_model_and_every_validation_shows_a_line(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)  # 16 frozen of 21
    cfg = _config(tmp_path, max_iter=4, val_every=2, verbose=True)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader(), _loader())
    out = capsys.readouterr().out
    assert "Model" in out and "Sequential: 21 parameters (5 trainable), 84 B float32" in out, out
    validations = [line for line in out.splitlines() if "val_loss" in line and line.startswith("epoch ")]
    assert [line.split(" | ")[0] for line in validations] == ["epoch 2/4", "epoch 4/4"], out  # print_every=0


def test_checkpoints_round_trip_rotate_and_load_weights_only(tmp_path):
    model = _model()
    cfg = _config(tmp_path, max_iter=5, checkpoint_every=1, keep_last_checkpoints=2)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg)
    trainer.fit(_loader())
    ckpts = Checkpointer(tmp_path / "run").checkpoints()
    assert [p.name for p in ckpts] == ["ckpt-e00004-s000000016.pt", "ckpt-e00005-s000000020.pt"]
    state = torch.load(ckpts[-1], weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    assert state["epoch"] == 5 and state["global_step"] == 20 and len(state["rng"]) == 1
    assert state["optimizer"]["state"] and state["config"]["max_iter"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)
    assert not list((tmp_path / "run" / "checkpoints").glob(".*tmp*"))


def _stop_at(epoch):
    def cb(trainer, config, writer):
        if trainer.current_epoch == epoch:
            raise KeyboardInterrupt("simulated crash")
    return Callback(on="train_epoch_end", callback=cb)


def _run(tmp_path, folder, max_iter=6, callbacks=(), resume=None, seed=0):
    model = _model(seed=seed, dropout=0.2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    cfg = _config(tmp_path, max_iter=max_iter, log_folder=tmp_path / folder, checkpoint_every=1, seed=3,
                  callbacks=list(callbacks), resume=resume)
    trainer = Trainer(model, opt, cfg, scheduler=sched)
    trainer.fit(_loader(40, 8, shuffle=True))
    return trainer


def test_exact_resume_after_a_crash_is_bitwise_identical(tmp_path):
    reference = _run(tmp_path, "ref")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "crash", callbacks=[_stop_at(4)])
    assert Checkpointer(tmp_path / "crash").latest().name.startswith("ckpt-e00003")
    resumed = _run(tmp_path, "crash", resume="auto", seed=99)  # different init: the checkpoint must win
    assert resumed.current_epoch == 6
    for k, v in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    assert resumed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]


def test_resume_from_explicit_missing_path_is_clear(tmp_path):
    model = _model()
    cfg = _config(tmp_path, resume=tmp_path / "nope.pt")
    with pytest.raises(OSError, match="does not exist"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader())


def test_seed_makes_runs_reproducible(tmp_path):
    a = _run(tmp_path, "a", max_iter=2).model.state_dict()
    b = _run(tmp_path, "b", max_iter=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_early_stopping_and_trainstop_criterion(tmp_path, capsys):
    model = _model()
    cfg = _config(tmp_path, max_iter=50, verbose=True,
                  callbacks=[EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=1, min_delta=10.0)])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg)
    trainer.fit(_loader())
    assert trainer.current_epoch == 2 and "EarlyStopping" in capsys.readouterr().out
    cfg2 = _config(tmp_path / "b", max_iter=50, trainstop_criterion=lambda t: t.current_epoch >= 3)
    trainer2 = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.01), cfg2)
    trainer2.fit(_loader())
    assert trainer2.current_epoch == 3


def test_best_checkpoint_and_lr_scheduler_callback(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = LRScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    cfg = _config(tmp_path, max_iter=3, val_every=1, checkpoint_best_only=True, callbacks=[sched])
    Trainer(model, opt, cfg, val_dataloader=_loader(8, 4)).fit(_loader())
    assert (tmp_path / "run" / "checkpoints" / "best.pt").exists()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert not Checkpointer(tmp_path / "run").checkpoints()  # best-only: no periodic files


def test_test_uses_its_own_loader_and_batch_count(tmp_path):
    model = _model()
    loss = CountingLoss()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path), loss_fn=loss,
                      test_dataloader=_loader(64, 8), max_batches=1)
    seen = []
    trainer.config.callbacks.append(Callback(on="test_batch_end", callback=lambda t, c, w: seen.append(1)))
    out = trainer.test()
    assert loss.calls == 8 and set(out) == {"test_loss", "test_mae"} and len(seen) == 8
    with pytest.raises(ConfigError, match="test\\(\\) needs a DataLoader"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path)).test()


def test_gradient_accumulation_matches_a_bigger_batch(tmp_path):
    def train(batch, accum):
        model = _model()
        cfg = _config(tmp_path, max_iter=2, gradient_accumulation_steps=accum, grad_clip_norm=100.0,
                      log_folder=tmp_path / f"acc{accum}")
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader(32, batch))
        return model.state_dict()

    a, b = train(16, 1), train(8, 2)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_bf16_mixed_precision_runs_on_cpu(tmp_path):
    """bf16 autocast on the CPU: the forward runs in bf16 (the loss is rounded as bf16 rounds it), the parameters
    stay float32 and learn, and the loss is finite."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = _config(tmp_path, max_iter=1, mixed_precision="bf16")
    trained, _ = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader())
    after = list(trained.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)), "the parameters did not move"
    import json

    rows = [json.loads(line) for line in next((tmp_path / "run").rglob("metrics.jsonl")).read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert trained(torch.randn(2, 3)).dtype == torch.bfloat16  # the same autocast the run used


def test_lbfgs_through_the_closure(tmp_path):
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    loss = CountingLoss()
    Trainer(model, opt, _config(tmp_path, max_iter=1), loss_fn=loss).fit(_loader(8, 8))
    assert loss.calls > 1  # LBFGS re-evaluated the closure


@pytest.mark.parametrize("kwargs, needle", [
    ({"loss_fn": "hinge"}, "loss_fn='hinge'"),
    ({"optimizer": "adam"}, "optimizer must be a torch.optim.Optimizer"),
    ({"config": {"max_iter": 1}}, "config must be a trainstack TrainConfig"),
])
def test_trainer_argument_errors(tmp_path, kwargs, needle):
    model = _model()
    args = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "config": _config(tmp_path)}
    with pytest.raises(ConfigError, match=needle):
        Trainer(**(args | kwargs))


def test_val_every_without_loader_and_custom_step_conflicts(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="no validation DataLoader"):
        Trainer(model, opt, _config(tmp_path, val_every=1)).fit(_loader())
    with pytest.raises(ConfigError, match="custom optimize_step"):
        Trainer(model, opt, _config(tmp_path, gradient_accumulation_steps=2), optimize_step=lambda *a, **k: None)


def test_tensorboard_and_loss_curve(tmp_path):
    model = _model()
    cfg = _config(tmp_path, tracking_tool="tensorboard", hyperparams={"lr": 0.1})
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg).fit(_loader())
    run = tmp_path / "run"
    assert list(run.glob("events.out.tfevents.*")) and (run / "loss_curve.svg").read_text().count("<polyline") >= 1
    assert json.loads((run / "hyperparams.json").read_text()) == {"lr": 0.1}


def test_fast_tensor_path_and_standard_loader_train_identically(tmp_path, monkeypatch):
    losses = {}

    def record(name):
        def cb(trainer, config, writer):
            losses.setdefault(name, []).append(trainer.opt_result.loss.item())
        return Callback(on="train_batch_end", callback=cb)

    params = {}
    for name, flag in (("fast", "1"), ("standard", "0")):
        monkeypatch.setenv("TRAINSTACK_FAST_TENSOR_PATH", flag)
        model = _model(dropout=0.2)
        cfg = _config(tmp_path, max_iter=3, seed=4, log_folder=tmp_path / name, callbacks=[record(name)])
        trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg)
        trainer.fit(_loader(40, 8, shuffle=True))
        params[name] = model.state_dict()
    assert losses["fast"] == losses["standard"] and len(losses["fast"]) == 15
    assert all(torch.equal(params["fast"][k], params["standard"][k]) for k in params["fast"])


# ---------------------------------------------------------------------------------------------- no silent wrong runs
def test_one_config_for_two_trainers_gives_two_runs(tmp_path):
    cfg = TrainConfig(max_iter=2, checkpoint_every=1, root_folder=tmp_path / "root", verbose=False,
                      compute_setup="cpu")
    first = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.01), cfg)
    first.optimizer = torch.optim.SGD(first.model.parameters(), lr=0.01)
    first.fit(_loader())
    second = Trainer(_model(1), torch.optim.SGD(_model(1).parameters(), lr=0.5), cfg)
    second.optimizer = torch.optim.SGD(second.model.parameters(), lr=0.5)
    second.fit(_loader())
    assert first.run_folder != second.run_folder and cfg.log_folder == Path("./")  # the config is never mutated
    state = torch.load(Checkpointer(first.run_folder).latest(), weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.01  # the first run's checkpoint is its own


def test_a_nan_loss_stops_with_the_last_finite_checkpoint_kept(tmp_path):
    class NaNAfter:
        calls = 0

        def __call__(self, model, batch):
            self.calls += 1
            x, y = batch
            loss = nn.functional.mse_loss(model(x), y)
            return loss * float("nan") if self.calls > 8 else loss  # epochs 1-2 finite, epoch 3 NaN

    model = _model()
    cfg = _config(tmp_path, max_iter=6, checkpoint_every=1, keep_last_checkpoints=2)
    with pytest.raises(TrainingDiverged, match="became nan in epoch 3") as exc:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=NaNAfter()).fit(_loader())
    kept = Checkpointer(tmp_path / "run").checkpoints()
    assert [p.name[:11] for p in kept] == ["ckpt-e00001", "ckpt-e00002"] and "ckpt-e00002" in str(exc.value)
    assert all(torch.isfinite(v).all() for v in torch.load(kept[-1], weights_only=True)["model"].values())
    on = _config(tmp_path, log_folder=tmp_path / "on", max_iter=4, stop_on_nonfinite=False)
    trainer = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), on, loss_fn=NaNAfter())
    trainer.fit(_loader())
    assert trainer.current_epoch == 4


@pytest.mark.parametrize("data, needle", [
    (TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), "a Dataset"),
    ((b for b in [1, 2]), "one-shot iterator"),
    (DataLoader(TensorDataset(torch.randn(0, 3), torch.randn(0, 1)), batch_size=4), "has no batches"),
    (5, "must be a DataLoader"),
])
def test_wrong_kinds_of_training_data_are_refused(tmp_path, data, needle):
    model = _model()
    with pytest.raises(ConfigError, match=needle):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path)).fit(data)


def test_resume_auto_with_nothing_to_resume_says_so(tmp_path, capsys):
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path, max_iter=1, resume="auto",
                                                                        verbose=True)).fit(_loader())
    assert "found no checkpoint" in capsys.readouterr().out


def test_resume_falls_back_when_the_newest_checkpoint_is_truncated(tmp_path, capsys):
    reference = _run(tmp_path, "ref", max_iter=4)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "cut", max_iter=4, callbacks=[_stop_at(4)])  # checkpoints e1..e3
    newest = Checkpointer(tmp_path / "cut").latest()
    newest.write_bytes(newest.read_bytes()[:1000])  # a copy cut short
    (newest.parent / f".{newest.name}.tmp-99999").write_bytes(b"left by a killed writer")
    resumed = _run(tmp_path, "cut", max_iter=4, resume="auto", seed=5)
    out = capsys.readouterr().out
    assert "ckpt-e00003" in out and "unreadable" in out and "ckpt-e00002" in out
    assert not list((tmp_path / "cut" / "checkpoints").glob(".*tmp*"))  # stale temp files removed at start
    for k, v in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k


@pytest.mark.timeout(120)
def test_a_second_run_on_a_live_folder_is_refused(tmp_path):
    import subprocess
    import sys

    code = ("import sys, time, torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
            "from trainstack import Callback, TrainConfig, Trainer\n"
            "slow = Callback(on='train_epoch_end', callback=lambda t, c, w: (print('epoch', flush=True), "
            "time.sleep(0.5)))\n"
            "m = nn.Linear(3, 1)\n"
            "cfg = TrainConfig(max_iter=60, log_folder=sys.argv[1], verbose=False, compute_setup='cpu', "
            "callbacks=[slow])\n"
            "Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1), cfg).fit(DataLoader(TensorDataset("
            "torch.randn(8, 3), torch.randn(8, 1)), batch_size=4))\n")
    live = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "epoch"
        model = _model()
        with pytest.raises(ConfigError, match="in use by another run"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _config(tmp_path, resume="auto")).fit(
                _loader())
    finally:
        live.kill()
        live.wait(timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_a_full_disk_names_the_cause_keeps_the_previous_checkpoint_and_leaves_no_temp_file(tmp_path, fmt):
    from helpers import small_tmpfs

    with small_tmpfs(tmp_path / "small", "3M") as disk:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 300), nn.Tanh(), nn.Linear(300, 300), nn.Linear(300, 1))  # ~0.4 MB
        cfg = _config(tmp_path, log_folder=disk / "run", max_iter=20, checkpoint_every=1, checkpoint_format=fmt)
        with pytest.raises(CheckpointError, match="the disk is full") as exc:
            Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), cfg).fit(_loader())
        assert "The previous checkpoint is kept" in str(exc.value) and "Traceback" not in str(exc.value)
        checkpoints = disk / "run" / "checkpoints"
        assert not list(checkpoints.glob(".*tmp*"))
        latest = Checkpointer(disk / "run").latest()
        assert latest is not None and Checkpointer(disk / "run").load()[0]["epoch"] >= 1


@pytest.mark.timeout(120)
def test_a_full_disk_while_writing_metrics_names_the_cause(tmp_path):
    from helpers import small_tmpfs

    from trainstack._runtime.writers import MetricsWriteError

    with small_tmpfs(tmp_path / "small", "64k") as disk:
        model = _model()
        cfg = _config(tmp_path, log_folder=disk / "run", max_iter=1000, log_every_n_steps=1)
        with pytest.raises(MetricsWriteError, match="metrics.jsonl: the disk is full. HINT: free space"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg).fit(_loader())


def test_a_plain_resume_keeps_every_metrics_row_exactly_once(tmp_path):
    """Rows are dropped by step, not by wall time: the row written ~0.2 ms before its checkpoint used to be
    rounded past it and lost about every other time."""
    for trial in range(6):
        folder = tmp_path / f"t{trial}"
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Trainer(model, opt, _config(folder, max_iter=3, checkpoint_every=1)).fit(_loader())
        Trainer(model, opt, _config(folder, max_iter=4, resume="auto")).fit(_loader())
        rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4], rows


def test_fast_dev_run_runs_the_whole_loop_and_keeps_nothing(tmp_path, capsys, monkeypatch):
    """N optimizer steps, a validation on N batches, the final checkpoint -- in a throw-away folder: no run folder,
    no temp folder left, and the spent Trainer refuses to go on as the real run."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    seen = []

    def loss_fn(model, batch):
        seen.append(model.training)
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y), {}

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = _config(tmp_path, max_iter=50, fast_dev_run=True, verbose=True, val_every=1, checkpoint_every=1)
    assert cfg.fast_dev_run == 1
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=loss_fn)
    trainer.fit(_loader(64, 8), _loader(64, 8))
    out = capsys.readouterr().out
    assert seen == [True, False], seen  # one training batch, one validation batch (of 8)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it did train
    assert "val_loss" in out and "fast_dev_run=1: 1 optimizer step(s), a validation on 1 batch(es)" in out, out
    [used] = [line.split("= ", 1)[1] for line in out.splitlines() if line.strip().startswith("Run folder")]
    assert used.startswith(str(tmp_path / "tmp" / "trainstack-fast-dev-run-")) and not Path(used).exists(), used
    assert not (tmp_path / "run").exists()
    assert trainer.config is cfg and cfg.fast_dev_run == 1
    with pytest.raises(ConfigError, match="ran fast_dev_run"):
        trainer.fit(_loader())
    with pytest.raises(ConfigError, match="fast_dev_run, which keeps no checkpoints"):
        trainer.load_checkpoint("best")
    with pytest.raises(ConfigError, match="fast_dev_run=-1"):
        _config(tmp_path, fast_dev_run=-1)


def _rows(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_value_logged_at_a_validation_is_everyones_at_that_step(tmp_path):
    """Lightning's perplexity idiom: exp(val_loss) logged in a val_epoch_end callback is seen by EarlyStopping and
    ModelCheckpoint after it, and lands on the validation's own row and step -- not on the next training row."""
    import math

    from trainstack.callbacks import ModelCheckpoint

    seen = []
    perplexity = Callback(on="val_epoch_end", callback=lambda t, c, w: t.log(
        "val_perplexity", math.exp(t.callback_metrics["val_loss"])))
    watch = Callback(on="val_epoch_end", callback=lambda t, c, w: seen.append(t.callback_metrics["val_perplexity"]))
    model = _model()
    cfg = _config(tmp_path, max_iter=30, val_every_n_steps=3, log_every_n_steps=2,
                  callbacks=[perplexity, watch, EarlyStopping(monitor="val_perplexity", patience=2, min_delta=1e6),
                             ModelCheckpoint(monitor="val_perplexity")])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, val_dataloader=_loader(8, 4))
    trainer.fit(_loader())  # 4 steps per epoch: validations at steps 3, 6, 9 (mid-epoch and at epoch ends)
    assert trainer.stop_reason.startswith("EarlyStopping: val_perplexity did not improve"), trainer.stop_reason
    rows = _rows(tmp_path / "run")
    with_ppl = [r for r in rows if "val_perplexity" in r]
    assert [r["step"] for r in with_ppl] == [3, 6, 9] and all("val_loss" in r for r in with_ppl), rows
    assert [r["val_perplexity"] for r in with_ppl] == pytest.approx(seen)
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in with_ppl)
    with pytest.raises(ConfigError, match="'step' is a column of every metrics row"):
        trainer.log("step", 1.0)


def test_an_early_stopped_run_is_finished_a_resume_has_nothing_to_train(tmp_path, capsys):
    model = _model()
    stop = EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=1, min_delta=10.0)
    cfg = _config(tmp_path, max_iter=50, checkpoint_every=1, resume="auto", verbose=True, callbacks=[stop])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg).fit(_loader())
    last = Checkpointer(tmp_path / "run").latest()
    assert last is not None and "e00002" in last.name
    capsys.readouterr()
    again = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.01), _config(
        tmp_path, max_iter=80, checkpoint_every=1, resume="auto", verbose=True,
        callbacks=[EarlyStopping(on="train_epoch_end", monitor="train_loss", patience=1, min_delta=10.0)]))
    again.fit(_loader())
    out = capsys.readouterr().out
    assert "NOTHING TO TRAIN" in out and "stopped at step 8 by EarlyStopping: train_loss did not improve" in out, out
    assert again.current_epoch == 2 and again.global_step == 8
    assert Checkpointer(tmp_path / "run").latest().name == last.name


def test_validation_test_and_predict_run_under_the_training_precision(tmp_path):
    seen = []

    def loss_fn(model, batch):
        x, y = batch
        out = model(x)
        seen.append(("train" if model.training else "eval", out.dtype))
        return nn.functional.mse_loss(out.float(), y)

    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), _config(
        tmp_path, max_iter=1, val_every=1, mixed_precision="bf16"), loss_fn=loss_fn, val_dataloader=_loader(8, 4))
    trainer.fit(_loader())
    trainer.test(_loader(8, 4))
    assert {d for phase, d in seen} == {torch.bfloat16} and {p for p, _ in seen} == {"train", "eval"}, seen
    predicted = trainer.predict(_loader(8, 4))
    assert predicted.dtype == torch.float32 and predicted.shape == (8, 1)  # autocast's bf16 comes back float32


def test_model_checkpoint_top_2_and_last_leaves_lightnings_three_files(tmp_path, capsys):
    from trainstack.callbacks import ModelCheckpoint

    model = _model()
    cfg = _config(tmp_path, max_iter=6, val_every=1, checkpoint_every=1, verbose=True,
                  callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)])
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, val_dataloader=_loader(8, 4)).fit(_loader())
    files = list((tmp_path / "run" / "checkpoints").iterdir())  # best.pt and last.pt are links to two of them
    assert len({f.stat().st_ino for f in files}) == 3, sorted(f.name for f in files)
    assert sum(f.name.startswith("best-val_loss") for f in files) == 2
    assert (tmp_path / "run/checkpoints/last.pt").exists()
    assert "periodic ones rotated: the newest 1 kept; a ModelCheckpoint keeps its own files" in capsys.readouterr().out

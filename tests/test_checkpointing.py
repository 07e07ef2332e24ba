"""ModelCheckpoint and SaveBestCheckpoint in one process: top-k by any metric, best and last in both formats,
exact after a crash and a resume."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.callbacks import ModelCheckpoint, SaveBestCheckpoint
from trainstack.checkpoint import Checkpointer, consolidate, describe
from trainstack.errors import ConfigError


def _data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def _loss(model, batch):
    x, y = batch
    out = model(x)
    loss = nn.functional.binary_cross_entropy_with_logits(out, y)
    return loss, {"acc": ((out > 0).float() == y).float().mean()}


def _fit(tmp_path, name="run", callbacks=(), resume=None, fmt="file", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    cfg = TrainConfig(**({"max_iter": 4, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "cpu",
                          "seed": 1, "val_every_n_steps": 2, "checkpoint_format": fmt, "resume": resume,
                          "callbacks": list(callbacks)} | kw))
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.05), cfg, loss_fn=_loss)
    trainer.fit(DataLoader(_data(), batch_size=8, shuffle=True), DataLoader(_data(24, seed=1), batch_size=8))
    return trainer


def _val_rows(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val_loss" in r]


def _kept(folder):
    return sorted(p.name for p in (folder / "checkpoints").iterdir() if p.name.startswith("best-"))


def test_top_k_keeps_exactly_k_files_with_the_best_values_and_best_names_the_best(tmp_path):
    trainer = _fit(tmp_path, callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=3)])
    folder = trainer.run_folder
    values = sorted((r["val_loss"], r["step"]) for r in _val_rows(folder))
    assert len(values) == 12  # every 2 of 24 steps (epoch ends included, once)
    kept = _kept(folder)
    # 6 steps per epoch; a file's epoch is the epochs finished when it was written
    assert kept == sorted(f"best-val_loss-e{s // 6:05d}-s{s:09d}.pt" for _, s in values[:3]), kept
    best = folder / "checkpoints" / "best.pt"
    assert os.path.samefile(best, folder / "checkpoints" / f"best-val_loss-e{values[0][1] // 6:05d}-s"
                                                          f"{values[0][1]:09d}.pt")
    info = describe(best)
    assert info["monitor"].startswith(f"val_loss = {values[0][0]:.6g}") and info["step"] == values[0][1]
    assert describe(folder)["best"].startswith(f"val_loss = {values[0][0]:.6g}")  # the final one knows the best


def test_mode_max_save_last_and_loading_best_and_last(tmp_path):
    trainer = _fit(tmp_path, callbacks=[ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2, save_last=True)])
    ckpts = trainer.run_folder / "checkpoints"
    accs = sorted((r["val_acc"] for r in _val_rows(trainer.run_folder)), reverse=True)
    kept = [torch.load(ckpts / name, weights_only=True)["monitor"]["value"] for name in _kept(trainer.run_folder)]
    assert sorted(kept, reverse=True) == pytest.approx(accs[:2]) and len(kept) == 2
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert (ckpts / "last.pt").is_file()
    assert trainer.load_checkpoint("best")
    best = torch.load(ckpts / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in best.items())
    assert trainer.load_checkpoint("last")
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in final.items())
    assert consolidate(trainer.run_folder, "best").keys() == best.keys()


class _Crash(Callback):
    """Fail once, at one step (as a killed job would: after files were written past the last checkpoint)."""

    def __init__(self, step, flag):
        super().__init__(on="optimizer_step")
        self.step, self.flag = step, flag

    def run_callback(self, trainer, config, writer):
        if trainer.global_step == self.step and not self.flag.exists():
            self.flag.touch()
            raise RuntimeError("simulated crash")


@pytest.mark.parametrize("fmt", ["file", "sharded"])
def test_after_a_crash_and_a_resume_top_k_is_what_an_uninterrupted_run_keeps(tmp_path, fmt):
    def top():
        return ModelCheckpoint(monitor="val_loss", save_top_k=2)

    reference = _fit(tmp_path, "ref", callbacks=[top()], fmt=fmt)
    flag = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path, "run", callbacks=[top(), _Crash(15, flag)], fmt=fmt, checkpoint_every_n_steps=8)
    stale = _kept(tmp_path / "run")  # written after the step-8 checkpoint: s10, s12, s14 may be among them
    resumed = _fit(tmp_path, "run", callbacks=[top(), _Crash(15, flag)], fmt=fmt, checkpoint_every_n_steps=8,
                   resume="auto")
    assert _kept(tmp_path / "run") == _kept(tmp_path / "ref") and len(_kept(tmp_path / "ref")) == 2, stale
    for k, v in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    ref_best = describe(tmp_path / "ref", "best")["monitor"]
    assert describe(tmp_path / "run", "best")["monitor"] == ref_best


def test_no_final_checkpoint_when_asked_but_the_periodic_ones_still(tmp_path):
    trainer = _fit(tmp_path, checkpoint_final=False, val_every_n_steps=0)
    assert not (trainer.run_folder / "checkpoints").exists() or not list((trainer.run_folder / "checkpoints").iterdir())
    trainer = _fit(tmp_path, "periodic", checkpoint_final=False, checkpoint_every=2, val_every_n_steps=0)
    assert Checkpointer(trainer.run_folder).latest() is not None  # epoch 2's and 4's periodic ones


def test_qadence_best_checkpoint_is_one_file_and_records_the_real_best(tmp_path):
    trainer = _fit(tmp_path, checkpoint_best_only=True)
    files = sorted(p.name for p in (trainer.run_folder / "checkpoints").iterdir())
    assert files == ["best.pt"]  # no periodic, no final, no top-k names
    state = torch.load(trainer.run_folder / "checkpoints" / "best.pt", weights_only=True)
    best = min(r["val_loss"] for r in _val_rows(trainer.run_folder))
    assert state["monitor"]["value"] == pytest.approx(best) and state["best_val_loss"] == pytest.approx(best)
    saver = SaveBestCheckpoint()
    _fit(tmp_path, "cb", callbacks=[saver])
    assert saver.best_val_loss == pytest.approx(min(r["val_loss"] for r in _val_rows(tmp_path / "cb")))


@pytest.mark.parametrize("kwargs, needle", [
    ({"mode": "median"}, "mode='median'"), ({"save_top_k": -2}, "save_top_k=-2"),
    ({"every_n_steps": 0}, "every_n_steps=0"), ({"monitor": ""}, "monitor=''"),
    ({"filename": "ckpt-x"}, "filename='ckpt-x'"), ({"filename": "a/b"}, "filename='a/b'")])
def test_bad_model_checkpoint_arguments(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        ModelCheckpoint(**kwargs)


def test_a_monitored_metric_that_does_not_exist_lists_what_does(tmp_path):
    with pytest.raises(ConfigError, match=r"'val_f1' not found; available: \[.*'val_acc'.*\]"):
        _fit(tmp_path, callbacks=[ModelCheckpoint(monitor="val_f1")])


@pytest.mark.parametrize("on", ["train_epoch_end", "val_epoch_end"])
def test_a_hand_called_save_best_compares_the_results_loss_as_qadence_does(tmp_path, on):
    """qadence's own callback test (UX review 4): a constructed Trainer whose opt_result holds loss=0.5 and only an
    accuracy metric -- the callback compares opt_result.loss (no val_loss was computed) and saves best.pt."""
    model = nn.Linear(2, 1)
    config = TrainConfig(log_folder=tmp_path, max_iter=1, val_every=1,
                         validation_criterion=lambda current, best, eps: current < best - eps)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), config, loss_fn="mse")
    trainer.opt_result.loss, trainer.opt_result.metrics, trainer.opt_result.iteration = 0.5, {"accuracy": 0.9}, 1
    callback = SaveBestCheckpoint(on=on, called_every=1)
    callback(on, trainer, config, None)
    assert (tmp_path / "checkpoints" / "best.pt").exists() and callback.best_val_loss == 0.5

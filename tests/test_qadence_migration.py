"""qadence `ml_tools` code moves over with only the package name changed, and its traps are gone.

One test per item of the migration issue: endless loaders, enable/disable_grad_opt, a new folder per fit, a second
fit, a reused folder, dicts of loaders, load_checkpoint, the optimize_step import; plus nevergrad for real.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainstack import Callback, TrainConfig, Trainer
from trainstack.errors import ConfigError


def _xy(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def _cfg(tmp_path, name="run", **kw):
    return TrainConfig(**({"max_iter": 3, "log_folder": tmp_path / name, "verbose": False, "compute_setup": "cpu"}
                          | kw))


class _Count:
    def __init__(self):
        self.batches = []

    def __call__(self, model, batch):
        self.batches.append(batch)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


@pytest.mark.timeout(60)
def test_an_endless_loader_takes_one_batch_per_epoch_or_max_batches(tmp_path):
    from trainstack import to_dataloader

    loss = _Count()
    model = _model()
    endless = to_dataloader(*_xy(), batch_size=4, infinite=True)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, "a", max_iter=5),
            loss_fn=loss).fit(endless)
    assert len(loss.batches) == 5  # qadence: one batch per iteration
    loss2 = _Count()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, "b", max_iter=5, max_batches=3),
            loss_fn=loss2).fit(endless)
    assert len(loss2.batches) == 15


class _Stream(IterableDataset):
    """A finite stream without a length (e.g. records read from files)."""

    def __iter__(self):
        x, y = _xy(24)
        return iter(zip(x, y, strict=True))


def test_a_finite_stream_without_length_ends_each_epoch_when_exhausted(tmp_path, capsys):
    loss = _Count()
    model = _model()
    cfg = _cfg(tmp_path, max_iter=2, verbose=True)
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=loss).fit(DataLoader(_Stream(),
                                                                                                 batch_size=8))
    assert len(loss.batches) == 6
    assert "until the loader ends" in capsys.readouterr().out  # the banner says how an epoch ends


def test_enable_and_disable_grad_opt_wrap_fit(tmp_path):
    ng = pytest.importorskip("nevergrad")
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, sgd, _cfg(tmp_path, "grad"))
    with trainer.enable_grad_opt():
        trainer.fit(DataLoader(TensorDataset(*_xy()), batch_size=8))
    assert trainer.use_grad and trainer.optimizer is sgd
    x, y = _xy(64, seed=1)
    ng_model = _model(3)
    before = nn.functional.mse_loss(ng_model(x), y).item()
    n = sum(p.numel() for p in ng_model.parameters())
    ng_opt = ng.optimizers.OnePlusOne(parametrization=n, budget=400)
    free = Trainer(ng_model, sgd, _cfg(tmp_path, "free", max_iter=40))
    with free.disable_grad_opt(ng_opt):
        free.fit(DataLoader(TensorDataset(x, y), batch_size=64))
        assert not free.use_grad and free.optimizer is ng_opt
    assert free.use_grad and free.optimizer is sgd  # both restored on exit
    recommended = torch.as_tensor(ng_opt.provide_recommendation().value, dtype=torch.float32)
    torch.nn.utils.vector_to_parameters(recommended, ng_model.parameters())
    assert nn.functional.mse_loss(ng_model(x), y).item() < before
    with pytest.raises(ConfigError, match="nevergrad optimizer"), free.disable_grad_opt():
        pass  # no nevergrad optimizer given or set: clear error, not a crash later


def test_create_subfolder_per_run_gives_each_fit_a_new_folder(tmp_path):
    model = _model()
    cfg = TrainConfig(max_iter=1, root_folder=tmp_path / "root", create_subfolder_per_run=True, verbose=False,
                      compute_setup="cpu")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    trainer.fit(DataLoader(TensorDataset(*_xy()), batch_size=8))
    first = trainer.run_folder
    trainer.fit(DataLoader(TensorDataset(*_xy()), batch_size=8))
    assert trainer.run_folder != first and first.exists() and trainer.run_folder.parent == tmp_path / "root"


def test_a_second_fit_continues_for_another_max_iter_and_says_so(tmp_path, capsys):
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, max_iter=3,
                                                                               checkpoint_every=1))
    loader = DataLoader(TensorDataset(*_xy()), batch_size=8)
    trainer.fit(loader)
    trainer.fit(loader)
    assert trainer.current_epoch == 6 and trainer.global_step == 24
    assert "continues the run" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_a_new_run_in_a_folder_with_checkpoints_is_refused_naming_resume(tmp_path):
    loader = DataLoader(TensorDataset(*_xy()), batch_size=8)
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path)).fit(loader)
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match="resume='auto'"):
        Trainer(_model(1), torch.optim.SGD(model.parameters(), lr=0.5), _cfg(tmp_path)).fit(loader)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_a_dict_of_loaders_gives_the_loss_a_dict_of_batches(tmp_path):
    seen = []

    def loss_fn(model, batch):
        seen.append(sorted(batch))
        (xa, ya), (xb, yb) = batch["a"], batch["b"]
        return nn.functional.mse_loss(model(xa), ya) + nn.functional.mse_loss(model(xb), yb)

    model = _model()
    loaders = {"a": DataLoader(TensorDataset(*_xy(32)), batch_size=8),
               "b": DataLoader(TensorDataset(*_xy(24, 1)), batch_size=8)}
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, max_iter=2), loss_fn=loss_fn).fit(
        loaders)
    assert seen == [["a", "b"]] * 6  # 3 batches per epoch: the shorter loader ends the pass


def test_qadence_dict_data_loader_class_works_too(tmp_path):
    from trainstack import DictDataLoader

    loader = DictDataLoader({"a": DataLoader(TensorDataset(*_xy(16)), batch_size=8)})
    assert len(loader) == 2 and [sorted(b) for b in loader] == [["a"], ["a"]]
    with pytest.raises(ConfigError, match="non-empty dict"):
        DictDataLoader({})


def test_load_and_write_checkpoint_with_qadence_signatures(tmp_path):
    from trainstack import load_checkpoint, write_checkpoint

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    Trainer(model, opt, _cfg(tmp_path, max_iter=2)).fit(DataLoader(TensorDataset(*_xy()), batch_size=8))
    fresh, fresh_opt = _model(9), torch.optim.Adam(_model(9).parameters(), lr=0.1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    out, out_opt, iteration = load_checkpoint(tmp_path / "run", fresh, fresh_opt)
    assert iteration == 2 and all(torch.equal(a, b) for a, b in zip(out.parameters(), model.parameters(),
                                                                    strict=True))
    write_checkpoint(tmp_path / "hand", fresh, fresh_opt, "best")
    assert load_checkpoint(tmp_path / "hand", _model(), None, model_ckpt_name="best.pt")[2] == 0


def test_the_optimize_step_import_path_translates(tmp_path):
    import trainstack
    from trainstack.optimize_step import optimize_step
    from trainstack.train_utils import Accelerator
    from trainstack.trainer import Trainer as SameTrainer

    assert SameTrainer is Trainer and Accelerator is trainstack.Accelerator
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, gradient_accumulation_steps=2),
                      optimize_step=optimize_step)  # the default step: allowed with accumulation
    trainer.fit(DataLoader(TensorDataset(*_xy()), batch_size=8))
    from trainstack import optimize_step as package_attribute  # after the submodule import: still usable

    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, "again"),
            optimize_step=package_attribute).fit(DataLoader(TensorDataset(*_xy()), batch_size=8))


def test_qadence_style_callback_and_hook_names_work(tmp_path):
    seen = []
    cbs = [Callback(on=event, called_every=1, callback=lambda t, c, w, e=event: seen.append(e))
           for event in ("train_start", "train_epoch_end", "train_end")]
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, max_iter=2, callbacks=cbs)).fit(
        DataLoader(TensorDataset(*_xy()), batch_size=8))
    assert seen == ["train_start", "train_epoch_end", "train_epoch_end", "train_end"]


def test_helpers_are_importable_from_the_package_root():
    import trainstack

    for name in ("DictDataLoader", "to_dataloader", "InfiniteTensorDataset", "OptimizeResult", "load_checkpoint",
                 "write_checkpoint"):
        assert getattr(trainstack, name) is not None
    assert len(trainstack.__all__) <= 10
    assert list(itertools.islice(iter(trainstack.InfiniteTensorDataset(torch.arange(3.0))), 7))


def test_an_overridden_qadence_hook_is_refused_not_silently_skipped(tmp_path):
    class MyTrainer(Trainer):
        def on_train_epoch_end(self, train_epoch_loss_metrics):
            raise AssertionError("never called")

    model = _model()
    with pytest.raises(ConfigError, match="on_train_epoch_end.*Callback\\(on='train_epoch_end'"):
        MyTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path))


def test_the_unused_batch_size_field_is_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="batch_size=32 is not used"):
        TrainConfig(batch_size=32)


def test_load_checkpoint_of_the_untouched_log_folder_finds_the_run(tmp_path, monkeypatch, capsys):
    """qadence code loads from trainer.config.log_folder, which qadence rewrote to the run folder; trainstack keeps
    the config as set (./), so ./ without checkpoints means the newest run under ./qml_logs, said out loud."""
    from trainstack import load_checkpoint

    monkeypatch.chdir(tmp_path)
    x, y = _xy()
    model = _model()
    cfg = TrainConfig(max_iter=2, verbose=False, compute_setup="cpu")
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert str(trainer.config.log_folder) == "." and trainer.run_folder.parent.name == "qml_logs"
    fresh = _model(seed=5)
    _, _, epoch = load_checkpoint(trainer.config.log_folder, fresh, None)
    assert epoch == 2 and str(trainer.run_folder) in capsys.readouterr().out
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_a_second_trainer_on_the_same_config_says_it_starts_a_new_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    x, y = _xy()
    cfg = TrainConfig(max_iter=1, compute_setup="cpu", checkpoint_every=1)
    first = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), cfg)
    first.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    capsys.readouterr()
    second = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), cfg)
    second.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    out = capsys.readouterr().out
    assert "an earlier run of this experiment is in" in out and str(first.run_folder) in out
    assert "resume='auto'" in out and second.run_folder != first.run_folder


def test_checkpoint_callbacks_called_directly_outside_fit(tmp_path):
    """qadence's own tests call SaveCheckpoint/LoadCheckpoint/SaveBestCheckpoint by hand."""
    from trainstack.callbacks import LoadCheckpoint, SaveBestCheckpoint, SaveCheckpoint
    from trainstack.checkpoint import Checkpointer

    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path))
    SaveCheckpoint().run_callback(trainer, trainer.config, trainer.writer)
    assert Checkpointer(tmp_path / "run").latest() is not None
    trainer.opt_result.loss = torch.tensor(0.5)  # qadence's SaveBestCheckpoint reads the result's loss
    best = SaveBestCheckpoint()
    best.run_callback(trainer, trainer.config, trainer.writer)
    assert (tmp_path / "run" / "checkpoints" / "best.pt").is_file() and best.best_val_loss == 0.5
    other = _model(seed=3)
    loader = Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), _cfg(tmp_path))
    LoadCheckpoint().run_callback(loader, loader.config, loader.writer)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v)


def test_a_loader_without_length_is_named_at_the_start(tmp_path, capsys):
    """A user's never-ending IterableDataset (not trainstack's own marked one) would run epoch 1 forever: the
    warning comes before the first batch, with the fix; max_batches bounds it (no warning then)."""
    model = _model()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, max_iter=1, verbose=True)).fit(
        DataLoader(_Stream(), batch_size=8))
    out = capsys.readouterr().out
    assert "the training loader has no length" in out and "max_batches" in out
    assert out.index("no length") < out.index("Running training")
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path, name="b", max_iter=1, verbose=True,
                                                                        max_batches=2)).fit(
        DataLoader(_Stream(), batch_size=8))
    assert "no length" not in capsys.readouterr().out


def test_the_traps_by_hand_say_what_they_did(tmp_path, monkeypatch, capsys):
    """The callbacks return what they did (the file saved, qadence's (model, optimizer, epoch)); a SaveBestCheckpoint
    with nothing to compare and a load from a folder without checkpoints say so instead of doing nothing."""
    from trainstack import load_checkpoint
    from trainstack.callbacks import LoadCheckpoint, SaveBestCheckpoint, SaveCheckpoint
    from trainstack.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    model = _model()
    fresh = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), _cfg(tmp_path))
    with pytest.raises(ConfigError, match="SaveBestCheckpoint: there is no loss to compare"):
        SaveBestCheckpoint().run_callback(fresh, fresh.config, fresh.writer)
    assert LoadCheckpoint().run_callback(fresh, fresh.config, fresh.writer) is None
    assert "LoadCheckpoint: no checkpoint to load in" in capsys.readouterr().out
    saved = SaveCheckpoint().run_callback(fresh, fresh.config, fresh.writer)
    assert saved is not None and saved.exists()
    loaded = LoadCheckpoint().run_callback(fresh, fresh.config, fresh.writer)
    assert loaded is not None and loaded[0] is model and loaded[2] == 0
    x, y = _xy()
    cfg = TrainConfig(max_iter=1, verbose=False, compute_setup="cpu", root_folder=tmp_path / "elsewhere")
    trained = Trainer(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), cfg)
    trained.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    capsys.readouterr()
    assert load_checkpoint(trained.config.log_folder, _model(seed=4))[2] == 0
    said = capsys.readouterr().out
    assert "nothing was loaded" in said and "HINT: pass trainer.run_folder" in said

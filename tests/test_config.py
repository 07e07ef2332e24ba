"""TrainConfig validation: every bad or contradictory setting fails at construction, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainstack import Callback, TrainConfig
from trainstack.errors import ConfigError


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_iter": -1}, "max_iter=-1"),
    ({"max_iter": 2.5}, "max_iter=2.5"),
    ({"print_every": True}, "print_every=True"),
    ({"nprocs": 0}, "nprocs=0"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"keep_last_checkpoints": 0}, "keep_last_checkpoints=0"),
    ({"max_batches": 0}, "max_batches=0"),
    ({"seed": -3}, "seed=-3"),
    ({"compute_setup": "tpu"}, "compute_setup='tpu'"),
    ({"backend": "ucc"}, "backend='ucc'"),
    ({"tracking_tool": "wandb"}, "tracking_tool='wandb'"),
    ({"mixed_precision": "fp8"}, "mixed_precision='fp8'"),
    ({"dtype": "float64"}, "dtype='float64'"),
    ({"val_epsilon": -1}, "val_epsilon=-1"),
    ({"grad_clip_norm": 0}, "grad_clip_norm=0"),
    ({"resume": 3}, "resume=3"),
    ({"root_folder": 5}, "root_folder=5"),
    ({"callbacks": [print]}, "callbacks must be a list of trainstack Callback"),
    ({"validation_criterion": "lower"}, "validation_criterion='lower'"),
    ({"hyperparams": [1]}, "hyperparams must be a dict"),
    ({"checkpoint_best_only": True}, "needs validation: set val_every"),
    ({"plot_every": 2}, "plotting_functions is empty"),
    ({"log_folder": "x", "create_subfolder_per_run": True}, "contradict each other"),
    ({"resume": "auto", "create_subfolder_per_run": True}, "cannot find earlier checkpoints"),
    ({"mixed_precision": "fp16", "compute_setup": "cpu"}, "needs CUDA"),
])
def test_bad_settings_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        TrainConfig(**kwargs)


def test_unknown_field_fails_at_construction():
    with pytest.raises(TypeError, match="batch_sizee"):
        TrainConfig(batch_sizee=3)


def test_positional_arguments_are_rejected():
    with pytest.raises(TypeError):
        TrainConfig(10)  # keyword-only: TrainConfig(max_iter=10)


def test_defaults_and_normalisation():
    cfg = TrainConfig(root_folder="logs", resume=False, callbacks=(Callback(callback=print),))
    assert cfg.root_folder == Path("logs") and cfg.resume is None and isinstance(cfg.callbacks, list)
    assert cfg.max_iter == 10000 and cfg.tracking_tool == "jsonl" and cfg.compute_setup == "auto"


def test_to_dict_is_plain_and_weights_only_loadable(tmp_path):
    cfg = TrainConfig(dtype=torch.float64, validation_criterion=lambda a, b, c: a < b, hyperparams={"lr": 0.1,
                      "obj": object()})
    d = cfg.to_dict()
    torch.save(d, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True) == d
    assert d["dtype"] == "torch.float64" and d["validation_criterion"] == "<lambda>"
    assert cfg.changed().keys() == {"dtype", "validation_criterion", "hyperparams"}

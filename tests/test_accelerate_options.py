"""Accelerate's configuration objects and constructor options: what trainstack takes, and a clear error naming the
option (and what to do instead) for what it does not -- never a silent ignore."""

from __future__ import annotations

import datetime

import pytest

from trainstack import Accelerator
from trainstack.errors import ConfigError
from trainstack.utils import (
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)


def test_mixed_precision_none_reads_accelerate_launch_s_variable(monkeypatch):
    assert Accelerator(mixed_precision=None).mixed_precision == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp4")
    with pytest.raises(ConfigError, match="ACCELERATE_MIXED_PRECISION='fp4'"):
        Accelerator()


def test_the_accumulation_plugin_sets_the_steps_and_both_at_once_is_an_error():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_each_batch=True))
    assert acc.gradient_accumulation_steps == 4 and acc.gradient_state.sync_each_batch
    with pytest.raises(ConfigError, match="num_steps=0"):
        GradientAccumulationPlugin(num_steps=0)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: DataLoaderConfiguration(dispatch_batches=True), "dispatch_batches=True"),
    (lambda: DataLoaderConfiguration(even_batches="yes"), "even_batches='yes'"),
    (lambda: DataLoaderConfiguration(data_seed=1.5), "data_seed=1.5"),
    (lambda: ProjectConfiguration(automatic_checkpoint_naming=True), "needs a project_dir"),
    (lambda: ProjectConfiguration(project_dir="p", total_limit=0), "total_limit=0"),
    (lambda: DistributedDataParallelKwargs(comm_wrapper="power_sgd"), "comm_wrapper='power_sgd'"),
    (lambda: ProfileKwargs(activities=["tpu"]), "'tpu'"),
    (lambda: Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")]), "joins the group itself"),
    (lambda: Accelerator(kwargs_handlers=[object()]), "object is not supported"),
    (lambda: Accelerator(log_with=["tensorboard", "comet_ml"]), "'comet_ml' is not a tracker"),
    (lambda: Accelerator(project_dir="a", project_config=ProjectConfiguration(project_dir="b")), "differ"),
    (lambda: Accelerator(dataloader_config={"split_batches": True}), "must be a DataLoaderConfiguration"),
    (lambda: Accelerator(even_batches=False), "DataLoaderConfiguration\\(even_batches"),
])
def test_what_is_not_taken_is_named(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


def test_handlers_reach_their_objects():
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook=DDPCommunicationHookType.FP16)
    acc = Accelerator(kwargs_handlers=[ddp, GradScalerKwargs(init_scale=1024.0),
                                       InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=90))])
    assert acc.handlers.ddp.to_kwargs() == {"find_unused_parameters": True}  # the hook is installed after wrapping
    assert acc.handlers.scaler.to_kwargs() == {"init_scale": 1024.0}
    assert acc.handlers.timeout_s == 90.0  # the process groups it joins or spawns use it


def test_log_with_takes_a_list_and_all(monkeypatch):
    assert Accelerator(log_with=["jsonl", "tensorboard"]).log_with == ("jsonl", "tensorboard")
    assert "jsonl" in Accelerator(log_with="all").log_with


def test_automatic_checkpoint_naming_numbers_and_rotates(tmp_path):
    import torch

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=config)
    model = acc.prepare(torch.nn.Linear(1, 1))
    for _ in range(3):
        acc.save_state()
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["checkpoint_1", "checkpoint_2"]
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state()  # the newest
    assert model.weight.abs().sum() > 0
    with pytest.raises(ConfigError, match="without a folder needs ProjectConfiguration"):
        Accelerator().save_state()

"""Step objects without a Trainer: accumulation equals a bigger batch, mixed precision keeps fp32 weights, LBFGS
goes through the closure, the boundary flag, and gradient-free nevergrad steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainstack import TrainConfig
from trainstack._train.steps import (
    AccumulatingStep,
    GradientFreeStep,
    PlainStep,
    check_step_options,
    make_step,
    mse_loss,
    optimize_step,
)
from trainstack.errors import ConfigError


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def test_accumulating_four_quarters_equals_one_full_batch():
    x, y = _data(16)
    full, quarters = _model(), _model()
    PlainStep(optimize_step, torch.optim.SGD(full.parameters(), lr=0.1), mse_loss, torch.device("cpu"), None)(
        full, (x, y))
    step = AccumulatingStep(torch.optim.SGD(quarters.parameters(), lr=0.1), mse_loss, "cpu", accumulation=4)
    step.begin_epoch(4)
    boundaries = []
    for i in range(4):
        step(quarters, (x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]))
        boundaries.append(step.at_boundary)
    assert boundaries == [False, False, False, True]
    for a, b in zip(full.parameters(), quarters.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_short_last_window_is_scaled_by_its_own_size():
    x, y = _data(12)
    full, acc = _model(), _model()
    step_full = AccumulatingStep(torch.optim.SGD(full.parameters(), lr=0.1), mse_loss, "cpu", accumulation=1)
    step_full.begin_epoch(1)
    step_full(full, (x[8:], y[8:]))
    step = AccumulatingStep(torch.optim.SGD(acc.parameters(), lr=0.1), mse_loss, "cpu", accumulation=2)
    step.begin_epoch(1)  # one batch left in this pass: the window is that batch alone, its loss is not halved
    step(acc, (x[8:], y[8:]))
    assert step.at_boundary
    for a, b in zip(full.parameters(), acc.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


def test_bf16_autocast_keeps_fp32_master_weights_and_clips():
    model = _model()
    step = AccumulatingStep(torch.optim.SGD(model.parameters(), lr=0.1), mse_loss, "cpu", clip_norm=0.01,
                            precision="bf16")
    before = [p.detach().clone() for p in model.parameters()]
    step.begin_epoch(None)
    loss, _ = step(model, _data())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before, strict=True)))
    assert 0 < moved.item() <= 0.1 * 0.01 + 1e-6  # lr * clipped norm
    assert step.state_dict() is None  # no GradScaler for bf16


def test_lbfgs_goes_through_the_closure():
    model = _model()
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        return mse_loss(m, batch)

    PlainStep(optimize_step, torch.optim.LBFGS(model.parameters(), max_iter=4), loss_fn, torch.device("cpu"),
              None)(model, _data())
    assert len(calls) > 1


def test_gradient_free_step_with_nevergrad():
    ng = pytest.importorskip("nevergrad")
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    optimizer = ng.optimizers.OnePlusOne(parametrization=n, budget=200)
    step = GradientFreeStep(optimizer, mse_loss)
    x, y = _data(32)
    first, _ = step(model, (x, y))
    for _ in range(150):
        last, _ = step(model, (x, y))
    recommended = torch.as_tensor(optimizer.provide_recommendation().value, dtype=torch.float32)
    torch.nn.utils.vector_to_parameters(recommended, model.parameters())
    assert mse_loss(model, (x, y))[0].item() < first.item()


def test_make_step_picks_the_kind_and_bad_combinations_are_refused():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    assert isinstance(make_step(TrainConfig(), sgd, mse_loss, optimize_step, True, cpu, None), PlainStep)
    assert isinstance(make_step(TrainConfig(gradient_accumulation_steps=2), sgd, mse_loss, optimize_step, True, cpu,
                                None), AccumulatingStep)
    with pytest.raises(ConfigError, match="custom optimize_step"):
        check_step_options(TrainConfig(grad_clip_norm=1.0), sgd, True, True)
    with pytest.raises(ConfigError, match="LBFGS"):
        check_step_options(TrainConfig(mixed_precision="bf16"), torch.optim.LBFGS(model.parameters()), False, True)
    check_step_options(TrainConfig(mixed_precision="fp16", compute_setup="cpu"), sgd, False, True)  # fine:
    fp16 = make_step(TrainConfig(mixed_precision="fp16"), sgd, mse_loss, optimize_step, True, cpu, None)
    assert fp16.scaler is not None and fp16.scaler._device == "cpu"  # CPU autocast with a CPU GradScaler
    with pytest.raises(ConfigError, match="gradient-free"):
        check_step_options(TrainConfig(nprocs=2), sgd, False, False)

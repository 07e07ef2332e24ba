"""The Accelerate-style loop pieces in one process (2+ processes: tests/distributed/test_accelerate_api.py):
optimizers and schedulers skip off the accumulation boundary, a plateau scheduler steps once per call."""

from __future__ import annotations

import pytest
import torch

from trainstack._runtime.loop import LoopState, PreparedOptimizer, PreparedScheduler, accumulate


def test_off_the_boundary_nothing_steps_and_plateau_schedulers_step_once_per_call():
    state = LoopState()
    state.accumulation = 2
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    prepared = PreparedOptimizer(optimizer, state=state)
    scheduler = PreparedScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), 2, state)
    before = model.weight.detach().clone()
    with accumulate(model, state):  # batch 1 of 2: no step
        model(torch.ones(1, 2)).sum().backward()
        prepared.step()
        scheduler.step()
    assert torch.equal(model.weight, before) and state.optimizer_steps == 0 and optimizer.param_groups[0]["lr"] == 1
    with accumulate(model, state):  # batch 2 of 2: one optimizer step, the schedule twice (2 processes' worth)
        model(torch.ones(1, 2)).sum().backward()
        prepared.step()
        scheduler.step()
    assert state.optimizer_steps == 1 and optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    assert isinstance(prepared, torch.optim.Optimizer) and prepared.param_groups is optimizer.param_groups
    plateau = PreparedScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1), 2, state)
    for value in (1.0, 1.0, 1.0):
        plateau.step(value)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)  # reduced once, after patience + 1 calls


def test_a_loss_backward_cannot_start_from_is_a_clear_error():
    """accelerator.backward(loss) checks on the host what autograd would reject deep inside torch."""
    from trainstack import Accelerator
    from trainstack.errors import ConfigError

    acc = Accelerator(nprocs=1)
    model = torch.nn.Linear(3, 2)
    out = model(torch.ones(4, 3))
    for loss, expected in ((out, "shape (4, 2)"), (out.sum().item(), "got a float"),
                           (out.detach().sum(), "does not require grad")):
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            acc.backward(loss)
    acc.backward(out, gradient=torch.ones_like(out))  # a non-scalar with its gradient is autograd's own form
    acc.backward(model(torch.ones(4, 3)).sum())
    assert model.weight.grad is not None

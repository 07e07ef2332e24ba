"""Losses and the per-batch optimisation step (closure-based, so LBFGS works)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import ConfigError

__all__ = ["optimize_step", "get_loss_fn", "mse_loss", "cross_entropy_loss", "call_loss", "LossFn"]

LossFn = Callable[[nn.Module, Any], Any]


def call_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Call a user loss that returns ``loss`` or ``(loss, metrics)``; always give back both."""
    out = loss_fn(model, batch)
    if type(out) is tuple:
        return out
    return out, {}


def mse_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    loss = nn.functional.mse_loss(model(inputs), targets)
    return loss, {"mse": loss}


def cross_entropy_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    loss = nn.functional.cross_entropy(model(inputs), targets)
    return loss, {"cross_entropy": loss}


_BUILTIN = {"mse": mse_loss, "cross_entropy": cross_entropy_loss}
# Exact types whose step(closure) calls the closure once, like loss.backward(); optimizer.step() does.
_NO_CLOSURE = {getattr(torch.optim, name) for name in ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta",
                                                       "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor")
               if hasattr(torch.optim, name)}


def get_loss_fn(loss_fn: str | LossFn | None) -> LossFn:
    """``"mse"`` (default), ``"cross_entropy"`` or a callable ``(model, batch) -> loss | (loss, metrics)``."""
    if loss_fn is None:
        return mse_loss
    if isinstance(loss_fn, str):
        if loss_fn not in _BUILTIN:
            raise ConfigError(f"loss_fn={loss_fn!r} is not a built-in loss; use one of {sorted(_BUILTIN)} or pass "
                              f"a function (model, batch) -> loss or (loss, metrics).")
        return _BUILTIN[loss_fn]
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} must be a string or a function (model, batch) -> loss.")
    return loss_fn


def optimize_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, xs: Any,
                  device: torch.device | None = None, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """One optimizer step on batch ``xs`` through a closure (LBFGS may call it several times).

    Optimizers known never to re-evaluate the loss take the same step without the closure machinery (fewer
    Python calls per step). Returns the (detached) loss and its metrics; no host synchronisation.
    """
    if type(optimizer) in _NO_CLOSURE:
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = call_loss(loss_fn, model, xs)
        loss.backward()
        optimizer.step()
        return loss.detach(), metrics
    result: list = [None, None]

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = call_loss(loss_fn, model, xs)
        loss.backward()
        result[0], result[1] = loss, metrics
        return loss

    optimizer.step(closure)
    return result[0].detach(), result[1]


def nevergrad_step(model: nn.Module, optimizer: Any, loss_fn: LossFn, xs: Any,
                   ng_params: Any) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """Gradient-free step: tell the optimizer the loss of the current candidate, then ask for the next one.

    Returns the loss, its metrics and the next candidate (to be told about on the following step).
    """
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    with torch.no_grad():
        loss, metrics = call_loss(loss_fn, model, xs)
    optimizer.tell(ng_params, float(loss))
    candidate = optimizer.ask()
    reference = parameters_to_vector(model.parameters())
    vector_to_parameters(torch.as_tensor(candidate.value, dtype=reference.dtype, device=reference.device),
                         model.parameters())
    return loss.detach(), metrics, candidate

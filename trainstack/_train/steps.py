"""How one batch becomes an optimizer step.

The loss contract is ``loss_fn(model, batch) -> loss | (loss, metrics)``. The Trainer asks ``make_step`` for
one step object and calls it once per batch; each kind owns its own state:

* ``PlainStep`` -- ``optimize_step`` (the closure-based default, so LBFGS works, or the user's function);
* ``AccumulatingStep`` -- gradient accumulation (DDP ``no_sync`` between optimizer steps), clipping, and
  mixed precision (autocast; a GradScaler for fp16), with its micro-batch counters;
* ``GradientFreeStep`` -- nevergrad's ask/tell on the flattened parameters.

``step.at_boundary`` is False while an optimizer step is half accumulated: the loop only stops or saves at a
boundary, so a checkpoint never holds half a step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from .._common.choices import SHARDING
from .._runtime.watchdog import heartbeat
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["optimize_step", "get_loss_fn", "mse_loss", "cross_entropy_loss", "call_loss", "LossFn", "Step",
           "PlainStep", "AccumulatingStep", "GradientFreeStep", "make_step", "check_step_options",
           "track_optimizer_steps"]

LossFn = Callable[[nn.Module, Any], Any]
StepResult = tuple[torch.Tensor, dict[str, Any]]


def call_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> StepResult:
    """Call a user loss that returns ``loss`` or ``(loss, metrics)``; always give back both."""
    out = loss_fn(model, batch)
    loss, metrics = out if type(out) is tuple and len(out) == 2 else (out, {})
    if type(loss) is not torch.Tensor or loss.ndim != 0 or not loss.is_floating_point():
        _bad_loss(loss_fn, loss)
    return loss, metrics


def _bad_loss(loss_fn: LossFn, loss: Any) -> None:
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if not isinstance(loss, torch.Tensor):
        what = f"a {type(loss).__name__} ({loss!r:.40})"
    elif loss.ndim != 0:
        what = f"a tensor of shape {tuple(loss.shape)}"
    else:
        what = f"a {loss.dtype} tensor"
    if isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.is_complex():
        return  # complex models: the user reduces to a real loss for backward; let torch decide
    raise ConfigError(f"loss_fn {name} returned {what}; it must return one floating-point scalar tensor (or "
                      f"(loss, metrics)) that backward() can start from. HINT: reduce it, e.g. loss.mean(), and "
                      f"keep it a tensor (no .item()).")


def mse_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    loss = nn.functional.mse_loss(model(inputs), targets)
    return loss, {"mse": loss}


def cross_entropy_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = batch
    logits = model(inputs)
    if logits.ndim == 2 and logits.shape[1] == 1:
        raise ConfigError("loss_fn='cross_entropy' needs one output per class, but the model gives 1 output: the "
                          "loss would be 0 whatever the weights. HINT: use loss_fn='mse' for regression, or "
                          "BCEWithLogitsLoss for a binary label.")
    loss = nn.functional.cross_entropy(logits, targets)
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
                  device: torch.device | None = None, dtype: torch.dtype | None = None) -> StepResult:
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

    def closure() -> Any:  # torch types it as returning float; optimizers use the loss tensor
        optimizer.zero_grad(set_to_none=True)
        loss, metrics = call_loss(loss_fn, model, xs)
        loss.backward()
        result[0], result[1] = loss, metrics
        return loss

    optimizer.step(closure)
    return result[0].detach(), result[1]


class Step(Protocol):
    """One batch -> (detached loss, metrics). Owns whatever state its kind of step needs."""

    @property
    def at_boundary(self) -> bool:
        """False while an optimizer step is half accumulated."""

    def __call__(self, model: nn.Module, batch: Any) -> StepResult: ...

    def begin_epoch(self, batches: int | None) -> None:
        """A pass starts with ``batches`` batches left (None: unknown)."""

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


class _Stateless:
    """The hooks of a step with no state across batches or passes (everything but accumulation)."""

    def begin_epoch(self, batches: int | None) -> None:
        pass

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


class PlainStep(_Stateless):
    """``optimize_step(model, optimizer, loss_fn, batch, device, dtype)``: the default or the user's own.

    The default with an optimizer that never re-evaluates the loss runs inline, marking its phases for the hang
    watchdog (attribute stores only).
    """

    at_boundary = True

    def __init__(self, fn: Callable[..., Any], optimizer: Any, loss_fn: LossFn, device: torch.device,
                 data_dtype: torch.dtype | None) -> None:
        self.fn, self.optimizer, self.loss_fn, self.device, self.data_dtype = fn, optimizer, loss_fn, device, data_dtype
        self.inline = fn is optimize_step and type(optimizer) in _NO_CLOSURE
        self.hb = heartbeat()

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        hb = self.hb
        if self.inline:
            optimizer = self.optimizer
            hb.phase = "forward"
            optimizer.zero_grad(set_to_none=True)
            loss, metrics = call_loss(self.loss_fn, model, batch)
            hb.phase = "backward"
            loss.backward()
            hb.phase = "optimizer"
            optimizer.step()
            return loss.detach(), metrics
        hb.phase = "step"
        return self.fn(model, self.optimizer, self.loss_fn, batch, self.device, self.data_dtype)


class AccumulatingStep:
    """Backward every batch, optimizer step every ``accumulation`` batches (and at the end of a pass).

    Gradients are scaled by the window size, so ``accumulation=A`` with batch ``B`` equals batch ``A*B``; DDP skips
    its gradient all-reduce inside a window (``no_sync``). ``clip_norm`` clips the global norm before each optimizer
    step; ``precision`` ``bf16``/``fp16`` runs forward and loss under autocast, fp16 with a GradScaler.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, loss_fn: LossFn, device_type: str, accumulation: int = 1,
                 clip_norm: float | None = None, precision: str = "no") -> None:
        self.optimizer, self.loss_fn, self.device_type = optimizer, loss_fn, device_type
        self.accumulation, self.clip_norm = accumulation, clip_norm
        self.amp_dtype = AMP_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device_type) if precision == "fp16" else None
        self.micro = 0  # batches accumulated into the current window
        self.left: int | None = None  # batches left in this pass (None: unknown)
        self.hb = heartbeat()

    @property
    def at_boundary(self) -> bool:
        return self.micro == 0

    def begin_epoch(self, batches: int | None) -> None:
        self.micro, self.left = 0, batches

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        self.micro += 1
        window = self.accumulation if self.left is None else min(self.accumulation, self.micro - 1 + self.left)
        if self.left is not None:
            self.left -= 1
        sync = self.micro >= window
        set_sync: Any = getattr(model, "set_requires_gradient_sync", None)
        if set_sync is not None:  # FSDP2: keep unsharded grads until the window's end
            set_sync(sync)
            no_sync = contextlib.nullcontext()
        else:  # DDP: skip the gradient all-reduce inside the window
            no_sync = getattr(model, "no_sync", contextlib.nullcontext)() if not sync else contextlib.nullcontext()
        hb = self.hb
        with no_sync:
            hb.phase = "forward"
            with torch.autocast(self.device_type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss, metrics = call_loss(self.loss_fn, model, batch)
            scaled = loss / window
            hb.phase = "backward"
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if sync:
            hb.phase = "optimizer"
            self._optimizer_step(model)
            self.micro = 0
        return loss.detach(), metrics

    def _optimizer_step(self, model: nn.Module) -> None:
        if self.clip_norm:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and self.scaler:
            self.scaler.load_state_dict(state)


class GradientFreeStep(_Stateless):
    """Tell a nevergrad optimizer the loss of the current candidate, then ask for the next one."""

    at_boundary = True

    def __init__(self, optimizer: Any, loss_fn: LossFn) -> None:
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self.candidate = optimizer.ask()

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        from torch.nn.utils import parameters_to_vector, vector_to_parameters

        with torch.no_grad():
            loss, metrics = call_loss(self.loss_fn, model, batch)
        self.optimizer.tell(self.candidate, float(loss))
        self.candidate = self.optimizer.ask()
        reference = parameters_to_vector(model.parameters())
        vector_to_parameters(torch.as_tensor(self.candidate.value, dtype=reference.dtype, device=reference.device),
                             model.parameters())
        return loss.detach(), metrics


def _special(config: TrainConfig) -> bool:
    return config.gradient_accumulation_steps > 1 or bool(config.grad_clip_norm) or config.mixed_precision != "no"


def is_custom_step(step: Any) -> bool:
    """Whether ``step`` is the user's own optimize_step (not trainstack's default, under either import path)."""
    return step not in (optimize_step, sys.modules.get("trainstack.optimize_step"))


def check_step_options(config: TrainConfig, optimizer: Any, custom_step: bool, use_grad: bool) -> None:
    """Combinations no step can honour, refused before any work starts."""
    if custom_step and _special(config):
        raise ConfigError("a custom optimize_step cannot be combined with gradient_accumulation_steps, "
                          "grad_clip_norm or mixed_precision (it owns the whole step). HINT: drop one of them.")
    if _special(config) and isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError("LBFGS re-evaluates the loss in a closure, which gradient accumulation, clipping and "
                          "mixed precision cannot follow. HINT: use them with a first-order optimizer.")
    if not use_grad and config.nprocs > 1:
        raise ConfigError("gradient-free training (use_grad=False) runs in one process; set nprocs=1.")
    if not use_grad and _special(config):
        raise ConfigError("gradient-free training (use_grad=False) has no gradients to accumulate, clip or scale. "
                          "HINT: drop gradient_accumulation_steps, grad_clip_norm and mixed_precision.")
    if getattr(config, "strategy", "ddp") in SHARDING:
        if not use_grad:
            raise ConfigError("strategy='fsdp' shards gradients, and gradient-free training has none (nevergrad sets "
                              "whole parameter vectors). HINT: use strategy='ddp' with use_grad=False.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("strategy='fsdp' cannot run LBFGS: it flattens every parameter into one vector, which "
                              "sharded (DTensor) parameters do not allow. HINT: use a first-order optimizer, or "
                              "strategy='ddp'.")


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_precision(config: TrainConfig) -> str:
    """The precision forwards run under autocast, in training and evaluation alike: ``mixed_precision`` (fp8: bf16
    around the float8 Linear layers), except bf16 under FSDP, which is FSDP's own policy (bf16 compute, fp32
    reduction) with no autocast on top of it."""
    precision = "bf16" if config.mixed_precision == "fp8" else config.mixed_precision
    return "no" if getattr(config, "strategy", "ddp") in SHARDING and precision == "bf16" else precision


def make_step(config: TrainConfig, optimizer: Any, loss_fn: LossFn, fn: Callable[..., Any], use_grad: bool,
              device: torch.device, data_dtype: torch.dtype | None) -> Step:
    """The step object for this configuration (validated by ``check_step_options``)."""
    if not use_grad:
        return GradientFreeStep(optimizer, loss_fn)
    if _special(config):
        return AccumulatingStep(optimizer, loss_fn, device.type, config.gradient_accumulation_steps,
                                config.grad_clip_norm, autocast_precision(config))
    return PlainStep(fn, optimizer, loss_fn, device, data_dtype)


def track_optimizer_steps(optimizer: Any) -> None:
    """Mark ``optimizer.step`` the way a torch LR scheduler does when it is built (``_opt_called``), again: an
    optimizer that crossed a process boundary lost the mark, and its scheduler would warn on every rank that
    ``optimizer.step()`` was overridden."""
    import functools
    import weakref

    if optimizer is None or hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step, ref = type(optimizer).step, weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper


class SeededStep:
    """``step`` with every optimizer step's random streams seeded from the run's seed, this rank and the step
    (``TrainConfig.seed_every_step``): a run restarted anywhere -- a rank restarted in place beside survivors that
    never stopped, a resume at another world size -- draws exactly what the uninterrupted run drew, without carrying
    RNG state. Seeded at the first batch of each optimizer step, after the loader's iterator drew its own."""

    def __init__(self, step: Step, seed: int, rank: int, at_step: Callable[[], int]) -> None:
        self._step, self._seed, self._rank, self._at_step = step, seed, rank, at_step

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def __call__(self, model: nn.Module, batch: Any) -> StepResult:
        if self._step.at_boundary:  # no batch of this optimizer step ran yet
            from ..accelerator import seed_everything
            from .resume import derived_seed

            seed_everything(derived_seed(self._seed, self._rank, self._at_step()))
        return self._step(model, batch)

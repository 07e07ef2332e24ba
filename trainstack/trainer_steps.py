"""How one training batch becomes an optimizer step (a Trainer mixin): the closure-based default, the
accumulation / clipping / mixed-precision path, and gradient-free nevergrad."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .steps import call_loss, nevergrad_step, optimize_step

__all__ = ["StepsMixin"]


class StepsMixin:
    """Chooses and runs the per-batch step; needs ``config``, ``optimizer``, ``loss_fn``, ``accelerator``."""

    def _check_step_options(self) -> None:
        cfg, custom = self.config, self.optimize_step is not optimize_step
        special = cfg.gradient_accumulation_steps > 1 or cfg.grad_clip_norm or cfg.mixed_precision != "no"
        if custom and special:
            raise ConfigError("a custom optimize_step cannot be combined with gradient_accumulation_steps, "
                              "grad_clip_norm or mixed_precision (it owns the whole step). HINT: drop one of them.")
        if special and isinstance(self.optimizer, torch.optim.LBFGS):
            raise ConfigError("LBFGS re-evaluates the loss in a closure, which gradient accumulation, clipping and "
                              "mixed precision cannot follow. HINT: use them with a first-order optimizer.")
        if cfg.mixed_precision == "fp16" and not self.accelerator.use_cuda:
            raise ConfigError("mixed_precision='fp16' needs a CUDA device; use 'bf16' or 'no' on CPU.")
        if not self.use_grad and cfg.nprocs > 1:
            raise ConfigError("gradient-free training (use_grad=False) runs in one process; set nprocs=1.")

    def _step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return self.optimize_step(model, self.optimizer, self.loss_fn, batch, self._device, self._data_dtype)

    def _amp_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Accumulation, clipping and mixed precision: backward every batch, optimizer step every A batches."""
        cfg, acc_steps = self.config, self.config.gradient_accumulation_steps
        self._micro += 1
        sync = self._micro == acc_steps or self._micro_left == 1
        self._micro_left -= 1
        no_sync = model.no_sync() if not sync and hasattr(model, "no_sync") else contextlib.nullcontext()
        with no_sync:
            with torch.autocast(self.accelerator.device.type, dtype=self._amp_dtype, enabled=self._amp_dtype
                                is not None):
                loss, metrics = call_loss(self.loss_fn, model, batch)
            scaled = loss / min(acc_steps, self._micro + self._micro_left)
            (self._scaler.scale(scaled) if self._scaler else scaled).backward()
        if sync:
            if cfg.grad_clip_norm:
                if self._scaler:
                    self._scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
            if self._scaler:
                self._scaler.step(self.optimizer)
                self._scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._micro = 0
        return loss.detach(), metrics

    def _ng_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics, self._ng_params = nevergrad_step(model, self.optimizer, self.loss_fn, batch, self._ng_params)
        return loss, metrics

    def _choose_step(self) -> None:
        cfg = self.config
        self._micro, self._micro_left = 0, 0
        if not self.use_grad:
            self._step, self._ng_params = self._ng_step, self.optimizer.ask()
        elif cfg.gradient_accumulation_steps > 1 or cfg.grad_clip_norm or cfg.mixed_precision != "no":
            self._amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.mixed_precision)
            self._scaler = torch.amp.GradScaler("cuda") if cfg.mixed_precision == "fp16" else None
            self._step = self._amp_step

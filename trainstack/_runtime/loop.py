"""What a hand-written loop needs besides processes, in HF Accelerate's spelling: gradient accumulation with DDP
sync only on the boundary, optimizers and schedulers that skip their step off the boundary, mixed precision
(autocast and, for fp16, a loss scaler), and the padding duplicates of a prepared loader's last batch, which
``gather_for_metrics`` drops.

One ``LoopState`` per process (Accelerate's ``GradientState``): prepared loaders write into it as they yield
(plain attribute stores), the Accelerator's helpers read it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["LoopState", "STATE", "PreparedOptimizer", "PreparedScheduler", "autocast_dtype", "autocast_forward",
           "tracked", "accumulate", "check_loss"]


class LoopState:
    """The position of the current loop on this rank."""

    def __init__(self) -> None:
        self.accumulation = 1  # gradient_accumulation_steps of the Accelerator that prepared the loop
        self.micro_step = 0  # batches seen inside accumulate() blocks
        self.sync_gradients = True  # this batch ends an accumulation window (or there is no accumulation)
        self.end_of_loader = False  # the batch just yielded is the last of its pass
        self.padding = 0  # duplicates at the end of that batch (a sampler pads shards to equal length)
        self.optimizer_steps = 0  # optimizer steps really taken (not skipped off the boundary)
        self.pending: Any = None  # run before a resumed pass's first batch (load_state's RNG restore)
        self.sync_each_batch = False  # all-reduce on every batch of a window (less memory, more traffic)
        self.sync_with_loader = True  # a loader's last batch ends a window

    def configure(self, accumulation: int, sync_each_batch: bool, sync_with_loader: bool) -> None:
        """The accumulation settings of the Accelerator that prepares the loop."""
        self.accumulation, self.sync_each_batch, self.sync_with_loader = accumulation, sync_each_batch, \
            sync_with_loader

    def batch_yielded(self, last: bool, padding: int) -> None:
        self.end_of_loader, self.padding = last, padding if last else 0


STATE = LoopState()


def count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A step post-hook for optimizers prepare() leaves unwrapped: ``accelerator.step`` counts their steps too."""
    STATE.optimizer_steps += 1


def tracked(batches: Iterator[Any], owner: Any, n_batches: int, padding: int, skipped: int,
            place: Any = None, state: LoopState = STATE) -> Iterator[Any]:
    """Batches of one pass (moved by ``place`` when given), telling ``state`` which is the last and how many
    duplicates it ends with, and ``owner`` (the loader) how far its pass is (``save_state``)."""
    owner.pass_epoch, owner.position = owner.epoch - 1, skipped
    for i, batch in enumerate(batches, 1):
        if state.pending is not None:
            pending, state.pending = state.pending, None
            pending()
        state.batch_yielded(i >= n_batches, padding)
        owner.position = skipped + i
        yield place(batch) if place is not None else batch
    state.end_of_loader, state.padding = False, 0


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under autocast, its floating outputs returned in fp32 (HF Accelerate's default), so
    the loss and the master weights stay in full precision."""
    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return _to_fp32(out)

    autocast_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    model.forward = autocast_forward


def remove_autocast_forward(model: nn.Module) -> None:
    """Undo ``autocast_forward``: the model's own forward again (``unwrap_model(keep_fp32_wrapper=False)``)."""
    forward = model.__dict__.get("forward")
    if forward is not None and getattr(forward, "__name__", "") == "autocast_forward":
        del model.forward


def _to_fp32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if isinstance(out, dict):
        return type(out)({k: _to_fp32(v) for k, v in out.items()})
    if isinstance(out, (list, tuple)) and not hasattr(out, "_fields"):
        return type(out)(_to_fp32(v) for v in out)
    return out


@contextlib.contextmanager
def accumulate(model: nn.Module | None, state: LoopState = STATE) -> Iterator[None]:
    """One batch of an accumulation window: gradients are all-reduced only on the window's last batch (or the
    loader's last), so DDP does no communication on the others."""
    state.micro_step += 1
    state.sync_gradients = state.accumulation <= 1 or state.micro_step % state.accumulation == 0 \
        or (state.end_of_loader and state.sync_with_loader)
    if state.sync_gradients:
        state.micro_step = 0  # a short window at the loader's end starts the next one afresh
    no_sync = getattr(model, "no_sync", None)
    skip_sync = not state.sync_gradients and not state.sync_each_batch
    context = no_sync() if (no_sync is not None and skip_sync) else contextlib.nullcontext()
    with context:
        yield


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only on an accumulation boundary (through the fp16 scaler when there is one).
    Everything else (``param_groups``, ``state``, ``state_dict`` ...) is the optimizer's own; it is still a
    ``torch.optim.Optimizer``, so schedulers can be built on it."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any = None, state: LoopState = STATE) -> None:
        # no super().__init__: the wrapped optimizer owns the parameter groups and the state
        self.optimizer, self.scaler, self._state = optimizer, scaler, state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Any = None) -> Any:
        if not self._state.sync_gradients:
            return None
        self._state.optimizer_steps += 1
        if self.scaler is not None:
            out = self.scaler.step(self.optimizer) if closure is None else self.scaler.step(self.optimizer, closure)
            self.scaler.update()
            return out
        return self.optimizer.step() if closure is None else self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """The user's scheduler, stepped only after a real optimizer step, ``world_size`` times per step -- HF
    Accelerate's behaviour, so a schedule sized on the whole (unsharded) loader ends when the data does.
    ``ReduceLROnPlateau`` follows its metric, not a step count: once per call."""

    def __init__(self, scheduler: Any, world_size: int, state: LoopState = STATE, follow_optimizer: bool = True
                 ) -> None:
        self.scheduler, self.world_size, self._state = scheduler, world_size, state
        self.follow_optimizer = follow_optimizer  # False: every call steps once, as the user wrote it

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.follow_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self._state.sync_gradients:
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):  # metric-driven: once per call
            self.scheduler.step(*args, **kwargs)
            return
        for _ in range(self.world_size):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR raises one step past its end
            if total is not None and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


# ---------------------------------------------------------------------------------------------------- the Accelerator's
# HF Accelerate's constructor keywords trainstack does not take, with what to do instead
_NOT_TAKEN = {
    "split_batches": "set it in DataLoaderConfiguration(split_batches=...) and pass dataloader_config=",
    "even_batches": "set it in DataLoaderConfiguration(even_batches=...) and pass dataloader_config=",
    "dispatch_batches": "not supported: every process reads its own shard of the same order",
    "deepspeed_plugin": "DeepSpeed is not supported: use strategy='fsdp' (FSDP2: parameters, gradients and "
                        "optimizer state sharded)",
    "fsdp_plugin": "use strategy='fsdp' with fsdp_blocks=(...) / fsdp_param_dtype=", "megatron_lm_plugin":
    "Megatron-LM is not supported", "torch_tp_plugin": "tensor parallelism is not supported by the Accelerator",
    "parallelism_config": "use strategy='fsdp'", "dynamo_backend": "use compile=True (or a dict of torch.compile "
    "options)", "dynamo_plugin": "use compile=True (or a dict of torch.compile options)",
    "fp8_recipe_handler": "fp8 is not supported", "deepspeed_plugins": "DeepSpeed is not supported"}


def refuse_keywords(unknown: dict[str, Any]) -> None:
    name = next(iter(unknown))
    known = ("nprocs, compute_setup, log_setup, dtype, backend, strategy, fsdp_blocks, fsdp_min_params, "
             "fsdp_param_dtype, hang_timeout, compile, join_process_group; HF Accelerate's device_placement, "
             "mixed_precision, gradient_accumulation_steps, gradient_accumulation_plugin, cpu, log_with, "
             "project_dir, project_config, dataloader_config, kwargs_handlers, rng_types, "
             "step_scheduler_with_optimizer")
    why = f" ({_NOT_TAKEN[name]})" if name in _NOT_TAKEN else ""
    raise ConfigError(f"Accelerator got an unknown keyword {name!r}{why}. It takes: {known}.")


def checkpointable(obj: Any) -> Any:
    if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise ConfigError(f"register_for_checkpointing: {type(obj).__name__} has no state_dict/load_state_dict.")
    return obj


def check_loadable(objects: list[Any]) -> None:
    """A registered object's state must load back as checkpoints are loaded (``torch.load(weights_only=True)``):
    refused now, at ``save_state``, naming what cannot -- not hours later at ``load_state``."""
    import io

    for obj in objects:
        buffer = io.BytesIO()
        torch.save(obj.state_dict(), buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except Exception as exc:
            what = str(exc).strip().splitlines()
            found = next((line.strip() for line in what if "GLOBAL" in line or "Unsupported" in line), what[0][:200]
                         if what else type(exc).__name__)
            raise ConfigError(f"save_state: the state of the registered {type(obj).__name__} could not be loaded "
                              f"back ({found}): checkpoints load with weights_only=True, which takes tensors, "
                              f"numbers, strings and containers of them. HINT: return plain values from its "
                              f"state_dict (e.g. a numpy array as a tensor, a datetime as its isoformat()).") from None



def check_loss(loss: Any, kwargs: dict[str, Any]) -> None:
    """What ``accelerator.backward(loss)`` needs, checked on the host (no sync): a tensor, one element unless a
    ``gradient`` is given, attached to the graph."""
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"accelerator.backward() got a {type(loss).__name__}, not the loss tensor. HINT: keep the "
                          f"loss a tensor until after backward (call .item() / float() for logging only).")
    if "gradient" not in kwargs and loss.numel() != 1:
        raise ConfigError(f"accelerator.backward(): the loss has shape {tuple(loss.shape)}; backward starts from one "
                          f"scalar. HINT: reduce it, e.g. loss.mean() (or pass gradient=...).")
    if not loss.requires_grad:
        raise ConfigError("accelerator.backward(): the loss does not require grad: it was computed under "
                          "torch.no_grad() / inference_mode, detached, or from parameters with requires_grad=False.")

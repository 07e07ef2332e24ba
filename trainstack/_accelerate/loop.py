"""HF Accelerate's loop vocabulary -- backward, accumulate, autocast, clipping, save_state/load_state, trackers --
as a base class of trainstack's ``Accelerator``, over the loop state of ``trainstack._runtime.loop``."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._common.choices import SHARDING
from .._runtime import loop as _loop
from ..errors import ConfigError
from .loader import skip_first_batches
from .state import AcceleratorState

if TYPE_CHECKING:
    from .config import AutocastKwargs, ProjectConfiguration
    from .options import Handlers

__all__ = ["AccelerateLoop"]

log = logging.getLogger("trainstack.accelerator")


class AccelerateLoop:
    """What a hand-written loop calls on the Accelerator in Accelerate's spelling. The Accelerator sets
    ``gradient_accumulation_steps``, ``mixed_precision``, ``scaler``, ``handlers``, ``project_configuration``,
    ``log_with``, ``strategy`` and the prepared objects; the process identity is its own."""

    gradient_accumulation_steps: int
    mixed_precision: str
    scaler: Any
    handlers: Handlers
    project_configuration: ProjectConfiguration
    log_with: tuple[str, ...] | None
    strategy: str
    _prepared: dict[str, list[Any]]
    _trackers: Any

    if TYPE_CHECKING:  # the Accelerator's
        @property
        def device(self) -> torch.device: ...

        @property
        def is_main_process(self) -> bool: ...

        @property
        def is_distributed(self) -> bool: ...

        @property
        def rank(self) -> int: ...

        @property
        def world_size(self) -> int: ...

        @property
        def state(self) -> AcceleratorState: ...

        def barrier(self) -> None: ...

    sync_gradients = property(lambda self: _loop.STATE.sync_gradients, doc="This batch ends an accumulation window.")
    step = property(lambda self: _loop.STATE.optimizer_steps, doc="Optimizer steps taken (restored by load_state).")

    # ------------------------------------------------------------------ a step
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (a loss it cannot start from is a clear error), divided for accumulation, fp16-scaled."""
        _loop.check_loss(loss, kwargs)
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)

    def accumulate(self, *models: nn.Module) -> contextlib.AbstractContextManager[None]:
        """``with accelerator.accumulate(model):`` around a batch: gradients sync and the prepared optimizer and
        schedulers step only on every ``gradient_accumulation_steps``-th batch (and the loader's last)."""
        return _loop.accumulate(models[0] if models else None)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager[Any]:
        """The block runs in ``mixed_precision`` (a no-op for ``"no"``); prepared models already do."""
        dtype = _loop.autocast_dtype(self.mixed_precision)
        if dtype is None:
            return contextlib.nullcontext()
        settings = (autocast_handler or self.handlers.autocast).to_kwargs()
        return torch.autocast(self.device.type, dtype=dtype, **settings)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' total norm (unscaled first under fp16); returns the norm before clipping."""
        self._unscale()
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self._unscale()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def _unscale(self) -> None:
        """fp16: gradients back to their true scale before clipping (once per optimizer step)."""
        if self.scaler is not None and _loop.STATE.sync_gradients:
            for optimizer in self._prepared["optimizer"]:
                self.scaler.unscale_(optimizer)

    # ------------------------------------------------------------------ state
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` that save_state/load_state also carry."""
        self._prepared["custom"].extend(_loop.checkpointable(obj) for obj in objects)

    def skip_first_batches(self, loader: Any, num_batches: int = 0) -> Any:
        """The prepared ``loader`` starting its next pass ``num_batches`` batches in (they are not loaded)."""
        return skip_first_batches(loader, num_batches)

    def save_state(self, output_dir: str | os.PathLike | None = None) -> Path | None:
        """Collective: prepared models, optimizers, schedulers, scaler, registered objects, RNGs, loader positions.
        Without a folder: the next ``project_dir/checkpoints/checkpoint_<n>`` (``automatic_checkpoint_naming``)."""
        from ..checkpoint import SAVE_STATE, Checkpointer

        folder = self._state_folder(output_dir, saving=True)
        self._same_folder("save_state", folder)
        if not _loop.STATE.sync_gradients and self.is_main_process:
            log.warning("save_state(%s) inside an accumulation window: its gradients so far are not saved, so a "
                        "resume differs from the uninterrupted run. HINT: save when accelerator.sync_gradients is "
                        "True.", folder)
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"save_state({str(folder)!r}): that is a file; save_state takes a folder (it writes "
                              f"{folder / 'checkpoints' / 'state.pt'}). HINT: a folder name, e.g. "
                              f"save_state('state').")
        _loop.check_loadable(self._prepared["custom"])
        counters = {"epoch": 0, "global_step": _loop.STATE.optimizer_steps, "micro_step": _loop.STATE.micro_step,
                    "loaders": [dl.state_dict() for dl in self._prepared["loader"]], "saved_by": SAVE_STATE}
        checkpointer = Checkpointer(folder, is_main=self.is_main_process, sharded=self.strategy in SHARDING)
        path = checkpointer.save(counters, self._state_parts(), name="state")
        self.barrier()
        return path

    def load_state(self, input_dir: str | os.PathLike | None = None) -> None:
        """Every rank restores ``save_state``'s state; loaders continue at the saved batch (bitwise resume).
        Without a folder: the newest automatically named checkpoint."""
        from ..checkpoint import Checkpointer, CheckpointError, restore_rng

        folder = self._state_folder(input_dir, saving=False)
        self._same_folder("load_state", folder)
        checkpointer = Checkpointer(folder, is_main=self.is_main_process, sharded=self.strategy in SHARDING)
        where = checkpointer.named("state")
        if where is None:
            raise CheckpointError(f"load_state({str(folder)!r}): no state saved there (save_state writes "
                                  f"{folder / 'checkpoints' / 'state.pt'}).")
        restored = checkpointer.restore(self._state_parts(), where, rank=self.rank)
        assert restored is not None
        counters = restored.counters
        _loop.STATE.optimizer_steps = int(counters["global_step"])
        _loop.STATE.micro_step = int(counters.get("micro_step", 0))
        mid_pass = False
        for loader, saved in zip(self._prepared["loader"], counters.get("loaders", []), strict=False):
            if isinstance(saved, (list, tuple)):  # written by trainstack <= 0.x: [epoch, position]
                saved = {"iteration": saved[0], "position": saved[1]}
            loader.load_state_dict(saved)
            mid_pass = mid_pass or bool(loader.skip_batches)
        rng = restored.rng
        if rng is not None:  # a new iterator draws from the RNG first: restore after it (as the Trainer does)
            if mid_pass:
                _loop.STATE.pending = lambda: restore_rng(rng)
            else:
                restore_rng(rng)

    def _state_parts(self) -> dict[str, Any]:
        parts: dict[str, Any] = {}
        for kind in ("model", "optimizer", "scheduler", "custom"):
            for i, obj in enumerate(self._prepared[kind]):
                parts[kind if i == 0 else f"{kind}_{i}"] = obj
        if self.scaler is not None:
            parts["scaler"] = self.scaler
        return parts

    def _same_folder(self, what: str, folder: Path) -> None:
        """Every process must name the same folder: the main process writes the state for all of them."""
        if not self.is_distributed:
            return
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, str(folder.resolve()))
        if len(set(everyone)) > 1:
            named = ", ".join(f"process {i}: {f}" for i, f in enumerate(everyone))
            raise ConfigError(f"{what}: the processes named different folders ({named}); the main process writes "
                              f"the state of all of them into one. HINT: give every process the same path (a "
                              f"tempfile.TemporaryDirectory() differs per process: make it on the main process and "
                              f"share its name with accelerator.broadcast).")

    def _state_folder(self, folder: str | os.PathLike | None, saving: bool) -> Path:
        """The folder given, else the automatically named one (``ProjectConfiguration``), keeping the newest
        ``total_limit``."""
        if folder is not None:
            return Path(folder)
        config = self.project_configuration
        what = "save_state()" if saving else "load_state()"
        if not config.automatic_checkpoint_naming or config.project_dir is None:
            raise ConfigError(f"{what} without a folder needs ProjectConfiguration(project_dir=..., "
                              f"automatic_checkpoint_naming=True). HINT: {what[:-1]}'folder').")
        root = Path(config.project_dir) / "checkpoints"
        numbered = sorted((p for p in root.glob("checkpoint_*") if p.name.rsplit("_", 1)[1].isdigit()),
                          key=lambda p: int(p.name.rsplit("_", 1)[1]))
        if not saving:
            if not numbered:
                raise ConfigError(f"load_state(): no checkpoint_<n> folder in {root}.")
            return numbered[-1]
        if self.is_main_process and config.total_limit is not None:
            for old in numbered[: max(0, len(numbered) + 1 - config.total_limit)]:
                shutil.rmtree(old, ignore_errors=True)
        config.iteration += 1
        return root / f"checkpoint_{config.iteration - 1}"

    # ------------------------------------------------------------------ trackers
    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, Any] | None = None) -> None:
        """Open ``log_with`` (and metrics.jsonl) in ``logging_dir/project_name`` on the main process."""
        if not self.is_main_process:
            self._trackers = None
            return
        from .._runtime.writers import make_writers

        folder = Path(self.project_configuration.logging_dir or ".") / project_name
        self._trackers = make_writers(self.log_with or "jsonl", folder)
        if config:
            self._trackers.log_hyperparams(config)

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Write ``values`` at ``step`` (default: optimizer steps so far) to the trackers (main process)."""
        if self._trackers is not None:
            self._trackers.write(self.step if step is None else step, values)

    def end_training(self) -> None:
        """Close the trackers (flushes TensorBoard/MLflow)."""
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None

"""Checkpoint state of a Trainer (a mixin): what is saved, how it is loaded on every rank, how a run stopped
mid-epoch continues exactly, and how rank 0's final state travels back to the launching process."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from . import collectives
from .callbacks import LRScheduler
from .checkpoint import BEST, FORMAT_VERSION, checkpoint_name, gather_rng, load_file, restore_rng
from .data import PreparedDataLoader, ResumableDistributedSampler

__all__ = ["StateMixin", "PREEMPTED"]

log = logging.getLogger(__name__)
PREEMPTED = "preempted"


class StateMixin:
    """Counters, checkpoints and graceful stops of the training loop."""

    def _start_epoch(self) -> tuple[Any, dict[str, Any], int, Iterable[Any]]:
        """Fresh accumulators and batches, or, after a mid-epoch checkpoint, its partial sums and the rest."""
        start, partial = self._resume_batch, self._resume_partial or {}
        self._resume_batch, self._resume_partial = 0, None
        self._micro_left = (self._batches_per_epoch() or 0) - start
        loader = self._train_loader
        if not start:
            return None, {}, 0, self._batches(loader, self.max_batches)
        cap = self.max_batches - start if self.max_batches else None
        if isinstance(loader, PreparedDataLoader) and isinstance(loader.sampler, ResumableDistributedSampler):
            loader.skip_batches(start)
            batches = self._batches(loader, cap)
        else:  # a loader we could not rebuild: replay the epoch and drop the consumed batches
            batches = itertools.islice(loader, start, self.max_batches)
        batches = iter(batches)  # the DataLoader iterator draws its base seed from the global RNG here ...
        if self._pending_rng is not None:  # ... so the saved RNG state is restored only after that draw
            restore_rng(self._pending_rng)
            self._pending_rng = None
        return partial.get("loss_sum"), dict(partial.get("sums") or {}), start, batches

    def _preempt_now(self, n: int, loss_sum: Any, sums: dict[str, Any]) -> bool:
        """Every rank asks at the same step; if any rank was asked to stop, all save and stop together."""
        local = self._stopper.requested()
        wanted = bool(local)
        if self.accelerator.world_size > 1:
            wanted = bool(collectives.all_reduce_dict({"stop": float(wanted)}, "max")["stop"])
        if not wanted:
            return False
        self._partial = {"batch_in_epoch": n, "loss_sum": loss_sum, "sums": sums}
        self._stop_for_preemption(local or "another rank was asked to stop")
        return True

    def _stop_for_preemption(self, why: str) -> None:
        self.stop_training, self.stop_reason = True, f"{PREEMPTED} ({why})"
        path = self.save_checkpoint()
        took = self.checkpointer.last_save_seconds
        marker = os.environ.get("TRAINSTACK_STOP_FILE")
        if marker and self.accelerator.is_main_process:  # tells the batch script: checkpoint complete, requeue me
            Path(marker + ".saved").write_text(str(path or self.checkpointer.latest()))
        self.console_print(f"Graceful stop at epoch {self.current_epoch}, step {self.global_step}: {why}. "
                           f"Checkpoint {path.name if path else '(already saved)'}"
                           f"{f' written in {took:.2f}s' if took else ''}.")

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (built on every rank: RNG states are gathered)."""
        sched = [cb for cb in self.callbacks.callbacks if isinstance(cb, LRScheduler)]
        return {"format_version": FORMAT_VERSION, "epoch": self.current_epoch, "global_step": self.global_step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.use_grad else None,
                "scaler": self._scaler.state_dict() if getattr(self, "_scaler", None) else None,
                "scheduler": sched[0].state_dict() if sched else None,
                "callbacks": self.callbacks.state_dict(), "rng": gather_rng(),
                "partial_epoch": self._partial or {"batch_in_epoch": 0},
                "world_size": self.accelerator.world_size, "config": self.config.to_dict()}

    def save_checkpoint(self, best: bool = False) -> Path | None:
        """Collective: every rank calls it, rank 0 writes ``ckpt-e<epoch>-s<step>.pt`` (or ``best.pt``)."""
        name = BEST if best else checkpoint_name(self.current_epoch, self.global_step)
        if not best and self._saved_at == self.global_step:
            return None  # already saved at this step (periodic + final): decided from memory, same on every rank
        path = self.checkpointer.save(self.state_dict(), name, self.accelerator.is_main_process)
        if not best:
            self._saved_at = self.global_step
        return path

    def load_checkpoint(self, path: Any = None) -> bool:
        """Load on **every** rank (``None``: the latest complete checkpoint of the run folder)."""
        target = Path(path) if path is not None else self.checkpointer.latest()
        if target is None:
            return False
        state = load_file(target)  # to CPU: load_state_dict copies onto the device; RNG states stay CPU tensors
        self.model.load_state_dict(state["model"])
        if state.get("optimizer") is not None and self.use_grad:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler") is not None and getattr(self, "_scaler", None):
            self._scaler.load_state_dict(state["scaler"])
        sched = [cb for cb in self.callbacks.callbacks if isinstance(cb, LRScheduler)]
        if sched and state.get("scheduler") is not None:
            sched[0].load_state_dict(state["scheduler"])
        self.callbacks.load_state_dict(state.get("callbacks", []))
        self.current_epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        partial = state.get("partial_epoch") or {}
        self._resume_batch, self._resume_partial = int(partial.get("batch_in_epoch", 0)), partial
        if isinstance(self._train_loader, PreparedDataLoader):
            self._train_loader.set_epoch(self.current_epoch)
        rngs = state.get("rng") or []
        if len(rngs) == self.accelerator.world_size:
            if self._resume_batch:
                self._pending_rng = rngs[self.accelerator.rank]  # restored once the epoch's iterator exists
            else:
                restore_rng(rngs[self.accelerator.rank])
        else:
            log.warning("checkpoint was written by %d processes, this run has %d: RNG states not restored, so the "
                        "continuation is not bitwise identical.", len(rngs), self.accelerator.world_size)
        where = f", batch {self._resume_batch} of the epoch" if self._resume_batch else ""
        self.console_print(f"Resumed from {target} (epoch {self.current_epoch}, step {self.global_step}{where}).")
        return True

    def _export(self) -> dict[str, Any]:
        """Rank 0's final state for the launching process (CPU tensors)."""
        opt_state = self.optimizer.state_dict() if self.use_grad else None
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": _to_cpu(opt_state), "epoch": self.current_epoch, "global_step": self.global_step,
                "run_folder": str(self.run_folder), "metrics": {k: float(v) for k, v in self.metrics.items()},
                "stop_reason": self.stop_reason}

    def _absorb(self, result: dict[str, Any]) -> None:
        self.model.load_state_dict(result["model"])
        if result["optimizer"] is not None:
            self.optimizer.load_state_dict(result["optimizer"])
        self.current_epoch, self.global_step = result["epoch"], result["global_step"]
        self.run_folder = Path(result["run_folder"])
        self.config.log_folder = self.run_folder
        self.metrics, self.stop_reason = result["metrics"], result["stop_reason"]




def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj

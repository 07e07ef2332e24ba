"""Hand-off between the launching process and its workers: what a spawned worker receives (configuration and state,
not the launcher's run handles), and rank 0's final state back in the user's own objects."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .progress import Progress, Stop

if TYPE_CHECKING:
    from ..callbacks import CallbackManager
    from ..trainer import Trainer

__all__ = ["export", "absorb", "to_cpu", "conclude"]


def export(trainer: Trainer, identity: dict[str, Any] | None) -> dict[str, Any] | None:
    """Rank 0's final state for the launching process (CPU tensors); a sharded model is gathered whole first (a
    collective: every rank calls this)."""
    from .._runtime.fsdp import full_state, is_sharded

    optimizer = trainer.optimizer if trainer.use_grad else None
    if is_sharded(trainer.model):
        model_sd, optim_sd = full_state(trainer.model, optimizer)
    else:
        model_sd = trainer.model.state_dict()
        optim_sd = optimizer.state_dict() if optimizer is not None else None
    if not trainer.accelerator.is_main_process:
        return None
    return {"model": to_cpu(model_sd), "optimizer": to_cpu(optim_sd),
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler else None,
            "callbacks": trainer.callbacks.state_dict(), "progress": trainer.progress.state_dict(),
            "run_folder": str(trainer.run_folder), "metrics": {k: float(v) for k, v in trainer.metrics.items()},
            "identity": identity}


def absorb(trainer: Trainer, result: dict[str, Any], callbacks: CallbackManager) -> dict[str, Any] | None:
    """Take rank 0's final state into the launching process's objects (``callbacks``: a manager over the user's);
    returns the run's experiment identity."""
    from .._runtime.fsdp import fqn_optimizer_to_indexed

    trainer.model.load_state_dict(result["model"])
    optim = result["optimizer"]
    if optim is not None:
        keys = [p for g in optim["param_groups"] for p in g["params"]]
        trainer.optimizer.load_state_dict(fqn_optimizer_to_indexed(optim) if keys and isinstance(keys[0], str)
                                          else optim)
    if result["scheduler"] is not None and trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(result["scheduler"])
    callbacks.load_state_dict(result["callbacks"])
    trainer.progress = Progress.from_state(result["progress"])
    trainer.run_folder = Path(result["run_folder"])
    trainer.metrics = result["metrics"]
    identity = result.get("identity")
    return identity if isinstance(identity, dict) else None


def conclude(trainer: Trainer) -> None:
    """The end of ``fit()`` in the launching process: a run that did not finish raises -- ``Preempted`` (a
    checkpoint to continue from) or ``TrainingDiverged``, or ``Interrupted`` after a Ctrl-C -- so the code after
    ``fit()`` never runs as if it had."""
    from ..errors import Interrupted, Preempted, TrainingDiverged

    stop, reason = trainer.progress.stop, trainer.progress.why
    again = (f"trainstack: {reason}; a complete checkpoint is in {trainer.run_folder}. Run again with resume='auto' "
             f"to continue exactly where it stopped.")
    if stop is Stop.INTERRUPTED:
        raise Interrupted(again)
    if stop is Stop.PREEMPTED:
        raise Preempted(again)
    if stop is Stop.DIVERGED:
        raise TrainingDiverged(f"trainstack: {reason}")


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj

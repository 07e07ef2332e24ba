"""Local SGD (Accelerate's ``LocalSGD``): processes train without synchronising gradients and average their
parameters every ``local_sgd_steps`` optimizer steps -- less communication, for slow interconnects."""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .state import DistributedType

if TYPE_CHECKING:
    from torch import nn

    from ..accelerator import Accelerator

__all__ = ["LocalSGD"]


class LocalSGD:
    """``with LocalSGD(accelerator, model, local_sgd_steps=8) as local_sgd:`` around an epoch; call
    ``local_sgd.step()`` after each optimizer step. Gradients stay local inside the block (DDP's ``no_sync``); the
    parameters are averaged every ``local_sgd_steps`` steps and when the block ends."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int, enabled: bool = True
                 ) -> None:
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ConfigError(f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): must be an integer >= 1.")
        supported = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        if accelerator.distributed_type not in supported:
            raise ConfigError(f"LocalSGD runs on data-parallel copies of the model (DDP); this Accelerator is "
                              f"{accelerator.distributed_type.value}. HINT: strategy='ddp', or no LocalSGD.")
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.enabled = enabled and accelerator.distributed_type != DistributedType.NO
        self.num_steps = 0
        self._no_sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        if self.enabled:
            if kind is None:  # a failing block must not wait in a collective its peers may never reach
                self._average()
            self._no_sync.__exit__(kind, exc, tb)

    def step(self) -> None:
        """One optimizer step done; every ``local_sgd_steps``-th averages the parameters (collective)."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")

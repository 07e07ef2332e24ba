"""The training metrics of one epoch: loss and metric sums kept on the device (no host sync per step), turned into
``train_*`` means at the epoch's end, and saved with a mid-epoch checkpoint so a resumed epoch ends with the same
numbers."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["EpochSums", "nonfinite_loss"]


class EpochSums:
    """Sums over the batches of the current epoch (``partial``: those a resumed epoch already had)."""

    def __init__(self, partial: dict[str, Any] | None = None) -> None:
        partial = partial or {}
        self.loss_sum: Any = partial.get("loss_sum")
        self.sums: dict[str, Any] = dict(partial.get("sums") or {})

    def add(self, loss: Any, metrics: dict[str, Any]) -> None:
        """One batch's loss and metrics (detached tensors: additions on the device, nothing waits)."""
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        for k, v in metrics.items():
            self.sums[k] = v.detach() if k not in self.sums else self.sums[k] + v.detach()

    def means(self, phase: str, batches: int, reduce: Any = None) -> dict[str, Any]:
        """``{phase}_loss`` and ``{phase}_<metric>`` averaged over ``batches``; ``reduce`` averages over ranks."""
        if batches == 0:
            return {}
        out = {f"{phase}_loss": self.loss_sum / batches, **{f"{phase}_{k}": v / batches for k, v in self.sums.items()}}
        return reduce(out) if reduce is not None else out


def nonfinite_loss(metrics: dict[str, Any]) -> bool:
    """The epoch's training loss is NaN or infinite (checked on the epoch mean: one host sync per epoch)."""
    loss = metrics.get("train_loss")
    return loss is not None and not math.isfinite(float(loss))

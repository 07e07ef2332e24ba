"""The training metrics: the loss and metric sums of one epoch kept on the device (no host sync per step), turned into
``train_*`` means at the epoch's end and saved with a mid-epoch checkpoint so a resumed epoch ends with the same
numbers; and the values users log with ``trainer.log`` (``MetricLog``)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["EpochSums", "MetricLog", "nonfinite_loss"]


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


_REDUCTIONS = {"mean": "mean", "sum": "sum", "max": "max", "min": "min"}
#: The columns every metrics row has of its own.
RESERVED = ("step", "epoch", "iteration", "time")


class MetricLog:
    """What ``trainer.log(name, value)`` collects between two logging boundaries: each value reduced over the steps
    of the interval (mean, sum, max or min), kept on its device (no host sync when logged); values logged with
    ``sync_dist=True`` are also reduced over the ranks when the interval is collected -- every rank must log them."""

    def __init__(self) -> None:
        self.values: dict[str, list[Any]] = {}  # name -> [accumulated, count, reduce, sync_dist]

    def add(self, name: str, value: Any, reduce: str = "mean", sync_dist: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"trainer.log: the name must be a non-empty string, got {name!r}.")
        if name in RESERVED:
            raise ConfigError(f"trainer.log({name!r}, ...): {name!r} is a column of every metrics row (where the row "
                              f"is); a value logged under it would replace it. HINT: another name, e.g. "
                              f"'my_{name}'.")
        if reduce not in _REDUCTIONS:
            raise ConfigError(f"trainer.log({name!r}, reduce={reduce!r}): must be one of {sorted(_REDUCTIONS)}.")
        value = _as_scalar(name, value)
        entry = self.values.get(name)
        if entry is None:
            self.values[name] = [value, 1, reduce, sync_dist]
            return
        acc = entry[0]
        if reduce in ("mean", "sum"):
            entry[0] = acc + value
        elif isinstance(acc, torch.Tensor) or isinstance(value, torch.Tensor):
            entry[0] = (torch.maximum if reduce == "max" else torch.minimum)(torch.as_tensor(acc), torch.as_tensor(
                value))
        else:
            entry[0] = max(acc, value) if reduce == "max" else min(acc, value)
        entry[1] += 1

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """What is logged inside belongs to what runs inside (a validation): the interval's values so far are set
        aside, and back after it, whatever it collected."""
        kept, self.values = self.values, {}
        try:
            yield
        finally:
            self.values = kept

    def current(self) -> dict[str, Any]:
        """This rank's values of the interval so far (no communication, nothing reset)."""
        return {name: acc / count if reduce == "mean" else acc for name, (acc, count, reduce, _) in self.values.items()}

    def collect(self, all_reduce: Any = None) -> dict[str, float]:
        """The interval's values as floats (``sync_dist`` ones reduced over ranks by ``all_reduce(dict, op)``, one
        collective per kind of reduction), then a new interval starts."""
        out = self.current()
        if all_reduce is not None:
            for op in sorted({e[2] for e in self.values.values() if e[3]}):
                names = sorted(n for n, e in self.values.items() if e[3] and e[2] == op)
                out.update(all_reduce({n: out[n] for n in names}, op))
        self.values = {}
        return {k: float(v) for k, v in out.items()}


def _as_scalar(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"trainer.log({name!r}, ...): got a tensor of shape {tuple(value.shape)}; log one "
                              f"number (e.g. value.mean()).")
        return value.detach().reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"trainer.log({name!r}, {value!r:.40}): the value must be a number or a one-element "
                          f"tensor.")
    return float(value)

"""A run continued on fewer processes than planned (the job's driver shrank it after a lost node with no spare
left): the global batch is kept by gradient accumulation where the planned world divides by this one, so every
optimizer step consumes the same samples, an epoch takes the same steps and the LR schedule stays on its step
count; where it does not divide, what changes is said."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._common import envvars as envvars

if TYPE_CHECKING:
    from ..config import TrainConfig

__all__ = ["keep_global_batch"]


def keep_global_batch(config: TrainConfig, world: int, planned: str | None, can_accumulate: bool,
                      say: Callable[[str], None]) -> TrainConfig:
    """``config`` for a run on ``world`` processes of ``planned`` (``TRAINSTACK_PLANNED_WORLD``, set by the driver
    only on a shrunk step): ``gradient_accumulation_steps`` times planned/world where that is whole and the step
    accumulates (``can_accumulate``: not a custom optimize_step), else unchanged -- said either way."""
    if not planned:
        return config
    try:
        want = int(planned)
    except ValueError:
        say(f"trainstack: {envvars.PLANNED_WORLD}={planned!r} is not a number of processes: ignored")
        return config
    if want <= world:
        return config
    steps = config.gradient_accumulation_steps
    if want % world == 0 and can_accumulate:
        factor = want // world
        say(f"trainstack: running on {world} of the {want} planned processes: gradient_accumulation_steps "
            f"{steps} -> {steps * factor}, so the global batch, the steps per epoch and the LR schedule are those "
            f"of the planned run.")
        return dataclasses.replace(config, gradient_accumulation_steps=steps * factor)
    why = "a custom optimize_step does not accumulate" if not can_accumulate else \
        f"{want} processes do not divide by {world}"
    say(f"trainstack: running on {world} of the {want} planned processes and the global batch cannot be kept ({why}): "
        f"each optimizer step now takes {world}/{want} of the planned batch, an epoch takes more steps, and the "
        f"LR schedule and max_steps count those steps.")
    return config

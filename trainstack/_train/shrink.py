"""A run on another number of processes than planned -- fewer (the job's driver shrank it after a lost node with no
spare left), or more (a run across clusters moved to a larger one): the global batch is kept by gradient
accumulation where the counts allow it, so every optimizer step consumes the same samples, an epoch takes the same
steps and the LR schedule stays on its step count. On fewer processes where they do not divide, what changes is
said; on more, a global batch that cannot be kept is refused with the reason -- never silently doubled."""

from __future__ import annotations

import dataclasses
import math
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
    if want == world or want < 1:
        return config
    steps = config.gradient_accumulation_steps
    if want < world:
        return _fewer_steps(config, world, want, steps, can_accumulate, say)
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


def _fewer_steps(config: TrainConfig, world: int, want: int, steps: int, can_accumulate: bool,
                 say: Callable[[str], None]) -> TrainConfig:
    """More processes than planned: the same global batch in fewer accumulation steps, where they divide
    (``gradient_accumulation_steps`` x planned / world whole); else a ``ConfigError`` that names the fix."""
    from ..errors import ConfigError

    if can_accumulate and (steps * want) % world == 0:
        fewer = steps * want // world
        say(f"trainstack: running on {world} processes, {want} planned: gradient_accumulation_steps {steps} -> "
            f"{fewer}, so the global batch, the steps per epoch and the LR schedule are those of the planned run.")
        return dataclasses.replace(config, gradient_accumulation_steps=fewer)
    raise ConfigError(f"this run was planned on {want} processes ({envvars.PLANNED_WORLD}={want}) and runs on "
                      f"{world}: its global batch would be {world}/{want} times the planned one (a different run: "
                      f"more samples per optimizer step, fewer steps per epoch, another LR schedule), and "
                      f"gradient_accumulation_steps={steps} cannot be divided by {world}/{want} to keep it. HINT: "
                      f"run it on {want} processes there (--nodes/--procs-per-node in that cluster's profile), or "
                      f"plan it with gradient_accumulation_steps a multiple of {world // math.gcd(world, want)}.")

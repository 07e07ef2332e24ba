"""No rollback for the survivors: a rank that continues in place (``_runtime/inplace.py``) keeps the state of its last
*completed* optimizer step, and a rank started beside it takes that state from a live peer instead of a checkpoint.

"Completed" is a property of the recorded position, not of luck: every optimizer step the loop marks once its
optimizer and learning-rate scheduler have stepped (``Mark``: the loop's counters at that batch and this rank's RNG
then); a failure later in the step (a duty's collective, a callback) leaves the parameters at the mark, a failure
before it (the gradient all-reduce) leaves them at the mark before. A rank whose parameters moved past its mark (it
failed between the optimizer step and the mark) cannot prove its state and offers none.

In the new job step's process group every rank says the step it holds (``agree``, one small all-gather); the
newest step any survivor holds is the one all continue from, and the lowest rank holding it sends its model,
optimizer, scheduler and loop state to every rank that holds another (``broadcast_object_list``: the replacement,
a survivor one step behind) -- under DDP every rank holds the same parameters. Nobody reads a checkpoint; the
dropped step is trained again with exactly its samples. Where no survivor holds a complete step, every rank
restores from the newest checkpoint as before (said). The replacement's RNG is derived from the seed, its rank and
the step (a survivor keeps its own); bytes and seconds of the transfer go to the job's timeline (``peer_state``).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._common import jobevents as jobevents
from ..checkpoint import Restored, load_parts, state_of

__all__ = ["Mark", "Held", "agree"]


@dataclass(frozen=True)
class Mark:
    """This rank after optimizer step ``step``: the loop's counters at that batch (a checkpoint's), its RNG, and the
    number of processes that trained it."""

    step: int
    counters: dict[str, Any]
    rng: dict[str, Any] | None
    world: int


@dataclass(frozen=True)
class Held:
    """What a rank continued in place holds: its last ``mark`` (None: none yet), and whether its parameters moved
    past it (``moved``: it failed between an optimizer step and that step's mark)."""

    mark: Mark | None
    moved: bool

    @property
    def step(self) -> int:
        """The complete step this rank can vouch for (-1: none)."""
        return self.mark.step if self.mark is not None and not self.moved else -1


def agree(held: Held | None, parts: Mapping[str, Any], rank: int, world: int) -> tuple[Restored | None, str]:
    """Collective over the new group: the newest step a survivor holds, its state sent to every rank holding
    another; this rank's ``Restored`` (None: no survivor holds a complete step -- restore from a checkpoint) and why
    not, in words."""
    mine = held.step if held is not None else -1
    steps: list[Any] = [None] * world
    dist.all_gather_object(steps, mine)
    target = max(int(s) for s in steps)
    if target < 0:
        return None, "no rank that continued in place holds a complete step"
    source = steps.index(target)
    receivers = [r for r, s in enumerate(steps) if s != target]
    mark = held.mark if held is not None else None
    if receivers:
        started = time.perf_counter()
        payload: list[Any] = [None]
        if rank == source:
            assert mark is not None
            payload = [{**mark.counters, "_world": mark.world,
                        **{name: state_of(part) for name, part in parts.items() if part is not None}}]
        dist.broadcast_object_list(payload, src=source)
        seconds = time.perf_counter() - started
        state = payload[0]
        if rank == 0:
            jobevents.record("peer_state", step=target, source_rank=source, receivers=receivers,
                             bytes=_size(state), seconds=round(seconds, 3))
        if rank in receivers:
            load_parts(parts, state, Path(f"rank {source}'s live state"))
            counters = {k: v for k, v in state.items() if k not in parts and k != "_world"}
            return Restored(counters, None, Path(f"rank {source}"), int(state["_world"]),
                            f"rank {source}'s live state at step {target} (no step redone)", "live"), ""
    assert mark is not None
    return Restored(dict(mark.counters), mark.rng, Path("live"), mark.world,
                    f"its own live state at step {target} (no step redone)", "live"), ""


def _size(state: Any) -> int:
    """Bytes of ``state``'s tensors, and of its pickle for the rest."""
    tensors = 0

    def walk(value: Any) -> Any:
        nonlocal tensors
        if isinstance(value, torch.Tensor):
            tensors += value.numel() * value.element_size()
            return None
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    rest = walk(state)
    return tensors + len(pickle.dumps(rest))

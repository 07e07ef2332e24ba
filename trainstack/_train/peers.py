"""No rollback for the survivors: a rank that continues in place (``_runtime/inplace.py``) keeps the state of its last
*completed* optimizer step, and a rank started beside it takes that state from a live peer instead of a checkpoint.

"Completed" is a property of the recorded position, not of luck: every optimizer step the loop marks once its
optimizer and learning-rate scheduler have stepped (``Mark``: the loop's counters at that batch and this rank's RNG
then); a failure later in the step (a duty's collective, a callback) leaves the parameters at the mark, a failure
before it (the gradient all-reduce) leaves them at the mark before. A rank whose parameters moved past its mark (it
failed between the optimizer step and the mark) cannot prove its state and offers none.

What a rank holds is a *shard* of the state: under DDP the whole of it (every rank the same: shard 0 of 1); under
HSDP its FSDP shard (``rank % shards`` of ``shards``), which each replica group holds once -- so a lost rank's shard
lives on in the other groups. FSDP2 binds a model's parameters to its group's mesh for good, so a sharded survivor
keeps a CPU copy of its local shards at the failure (``Held.state``) and its model is built again over the new mesh
(``Blueprint``) before it loads them.

In the new job step's process group every rank says the step and shard it holds and the shard it needs (``agree``,
one small all-gather); the newest step at which every needed shard has a holder is the one all continue from, and
the lowest rank holding each shard sends it (model, optimizer, scheduler, loop state) to every rank that needs it and
holds another (the replacement, a survivor one step behind, a survivor renumbered by a shrink). Nobody reads a
checkpoint; the dropped step is trained again with exactly its samples. Where some needed shard has no holder (plain
FSDP: one copy of each shard; two ranks of one shard lost), every rank restores from the newest checkpoint as before
(said). The replacement's RNG is derived from the seed, its rank and the step (a survivor keeps its own); bytes and
seconds of the transfer go to the job's timeline (``peer_state``).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._common import jobevents as jobevents
from .._runtime.fsdp import at_rest, is_sharded
from ..checkpoint import Restored, laid_out, load_parts, staged, state_of

if TYPE_CHECKING:
    from torch import nn

    from .._runtime.parallel import Layout

__all__ = ["Mark", "Held", "Shard", "agree", "plan_transfer", "shard_of", "holding", "commit_points",
           "NOTHING_TO_RESTORE"]

#: Which shard of the state a rank holds or needs: (index, count). DDP: (0, 1).
Shard = tuple[int, int]


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
    """What a rank continued in place holds: its last ``mark`` (None: none yet), whether its parameters moved past it
    (``moved``: it failed between an optimizer step and that step's mark), which ``shard`` of the state it holds,
    and -- for a sharded model, rebuilt over the next group's mesh -- a CPU copy of its parts (``state``: staged
    local shards; None: its live parts are kept)."""

    mark: Mark | None
    moved: bool
    shard: Shard = (0, 1)
    state: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        """The complete step this rank can vouch for (-1: none)."""
        return self.mark.step if self.mark is not None and not self.moved else -1


def shard_of(layout: Layout, rank: int) -> Shard:
    """Which shard of the state ``rank`` holds in ``layout``: its FSDP shard under FSDP/HSDP (each replica group
    holds every shard once), the whole under DDP (shard 0 of 1)."""
    return layout.data_rank(rank) % layout.shard, layout.shard


def holding(mark: Mark | None, step: int, model: nn.Module, parts: Mapping[str, Any], shard: Shard) -> Held:
    """What a rank at optimizer step ``step`` holds as it leaves its failed group to continue in place: its last
    mark, whether its parameters moved past it, its shard and -- a sharded model is built again over the next
    group's mesh -- a CPU copy of its parts' local shards at the mark (none where it moved past it)."""
    moved = mark is None or mark.step != step
    state = None
    if not moved and is_sharded(model):
        try:
            at_rest(model)
            state = staged({name: state_of(part) for name, part in parts.items() if part is not None})
        except Exception as exc:  # noqa: BLE001 -- then it offers nothing: it leaves and is relaunched
            print(f"trainstack: this rank's local shards could not be copied at step {step} ({exc!r}): it cannot "
                  f"continue in place", file=sys.stderr, flush=True)
    return Held(mark, moved, shard, state)


def commit_points(optimizer: torch.optim.Optimizer | None, model: nn.Module, precision: str,
                  releases: contextlib.ExitStack) -> None:
    """For a sharded model restarted in place: a barrier before every optimizer step (a pre-hook, removed by
    ``releases``). A shard lives only on its replicas, so the survivors must hold the same step: without it, a rank
    whose gradient collectives finished steps on while its shard's other holder failed in one (the lost ranks died
    between two of a step's collectives), and no step is then held for every shard. Past the barrier every rank
    has its gradients; before it none has stepped. Not under fp16, whose GradScaler skips a step by its own rank's
    overflow check: a barrier there could wait for ever."""
    if optimizer is None or not is_sharded(model) or precision == "fp16":
        return
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: dist.barrier())
    releases.callback(handle.remove)


#: A rank whose sharded model was built again, with no complete set held by the survivors and no checkpoint.
NOTHING_TO_RESTORE = ("rank {rank} continued in place with its sharded model built again for the new group, but no "
                      "rank holds a complete set of the state and there is no checkpoint to restore it from. HINT: "
                      "set checkpoint_every_n_steps (or memory checkpoints) so that a double fault before the first "
                      "one has a state to return to.")


def plan_transfer(offers: list[tuple[int, Shard | None, Shard]]) -> tuple[int, dict[int, int]] | str:
    """Per rank (held step, held shard or None, needed shard): the newest step at which every needed shard has a
    holder, and for every rank the rank it takes its state from (itself where it holds what it needs: the lowest
    holder otherwise); or why there is none, in words."""
    steps = sorted({step for step, held, _ in offers if step >= 0 and held is not None}, reverse=True)
    if not steps:
        return "no rank that continued in place holds a complete step"
    missing = ""
    for step in steps:
        holders: dict[Shard, list[int]] = {}
        for rank, (at, held, _) in enumerate(offers):
            if at == step and held is not None:
                holders.setdefault(held, []).append(rank)
        lacking = sorted({need for _, _, need in offers if need not in holders})
        if not lacking:
            return step, {rank: rank if rank in holders[need] else holders[need][0]
                          for rank, (_, _, need) in enumerate(offers)}
        missing = missing or f"no rank holds shard {lacking[0][0]} of {lacking[0][1]} at step {step}"
    return f"{missing} (the survivors hold no complete set of the state)"


def agree(held: Held | None, parts: Mapping[str, Any], rank: int, world: int, need: Shard = (0, 1)
          ) -> tuple[Restored | None, str]:
    """Collective over the new group: the newest step every needed shard is held at, each shard sent by its lowest
    holder to every rank needing it; this rank's ``Restored`` (None: no complete set is held -- restore from a
    checkpoint) and why not, in words."""
    step = held.step if held is not None else -1
    mine = (step, held.shard if held is not None and step >= 0 else None, need)
    offers: list[Any] = [None] * world
    dist.all_gather_object(offers, mine)
    plan = plan_transfer([(int(s), tuple(h) if h is not None else None, tuple(n)) for s, h, n in offers])
    if isinstance(plan, str):
        return None, plan
    target, sources = plan
    started = time.perf_counter()
    received = _exchange(held, parts, rank, sources)
    source = sources[rank]
    if rank != source or (held is not None and held.state is not None):  # received, or rebuilt: load it
        state = received if rank != source else _payload(held, parts)
        load_parts(parts, laid_out(state, parts), Path(f"rank {source}'s live state"))
    receivers = sorted(r for r, s in sources.items() if r != s)
    if receivers:
        seconds = time.perf_counter() - started
        sizes: list[Any] = [None] * world  # what each receiver took: the bytes moved
        dist.all_gather_object(sizes, _size(received) if rank != source else 0)
        if rank == 0:
            jobevents.record("peer_state", step=target, source_rank=sources[receivers[0]], receivers=receivers,
                             sources={str(r): sources[r] for r in receivers}, bytes=sum(sizes),
                             seconds=round(seconds, 3))
    if rank != source:
        counters = {k: v for k, v in received.items() if k not in parts and k != "_world"}
        return Restored(counters, None, Path(f"rank {source}"), int(received["_world"]),
                        f"rank {source}'s live state at step {target} (no step redone)", "live"), ""
    assert held is not None and held.mark is not None
    mark = held.mark
    return Restored(dict(mark.counters), mark.rng, Path("live"), mark.world,
                    f"its own live state at step {target} (no step redone)", "live"), ""


def _payload(held: Held | None, parts: Mapping[str, Any]) -> dict[str, Any]:
    """What a holder sends: the loop's counters at its mark and its parts' state (the staged copy of a rebuilt
    model's, else the live parts')."""
    assert held is not None and held.mark is not None
    mark = held.mark
    state = held.state if held.state is not None else \
        {name: state_of(part) for name, part in parts.items() if part is not None}
    return {**mark.counters, "_world": mark.world, **state}


def _exchange(held: Held | None, parts: Mapping[str, Any], rank: int, sources: dict[int, int]) -> dict[str, Any]:
    """Point to point, receivers in order: each holder sends its payload to the ranks taking it from it; what this
    rank received (nothing where it takes its own)."""
    sending: dict[str, Any] | None = None
    received: dict[str, Any] = {}
    for receiver, source in sorted(sources.items()):
        if receiver == source:
            continue
        if rank == source:
            sending = sending if sending is not None else _payload(held, parts)
            dist.send_object_list([sending], dst=receiver)
        elif rank == receiver:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=source)
            received = box[0]
    return received


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

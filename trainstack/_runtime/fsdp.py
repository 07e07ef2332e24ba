"""FSDP2 (``torch.distributed.fsdp.fully_shard``): shard a model's blocks, then its root, so every rank holds
1/N of the parameters, gradients and optimizer state; and get the whole state back at the end of a run.

Blocks are chosen by class name (``fsdp_blocks=("TransformerEncoderLayer",)``) or, by default, as the largest
submodules holding at least ``fsdp_min_params`` parameters each (a size-based policy, bottom-up).

FSDP2 binds a model's parameters to one mesh for good: a rank restarted in place (HSDP) shards a fresh copy of the
model over the next group's mesh, built from the ``Blueprint`` kept before the first sharding.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ONE_PROCESS_NOTE", "shard", "pick_blocks", "is_sharded", "module_classes", "check_blocks", "full_state",
           "fqn_optimizer_to_indexed", "Blueprint", "at_rest"]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def at_rest(model: nn.Module) -> None:
    """Every FSDP module of ``model`` with its sharded parameters registered (none left gathered by a forward that
    failed): its state dict is then its local shards. No collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Blueprint:
    """A model's structure kept before it is sharded: its parameters on the meta device (no memory), its buffers as
    they were (a non-persistent buffer -- a rotary table -- is in no state dict, so a restore would not set it).

    FSDP2 binds a sharded model to its group's mesh for good, so a rank continued in place trains a fresh one
    (``build``); the model trained is one trainstack alone holds from the start (``own``), so the module passed in
    is the same (placeholders) whether a failure came or not, and a failed model's memory is released at once."""

    def __init__(self, model: nn.Module) -> None:
        memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                                for p in model.parameters()}
        self._model = copy.deepcopy(model, memo)

    @staticmethod
    def own(model: nn.Module) -> nn.Module:
        """A module of ``model``'s structure holding its parameters and buffers (the same objects: an optimizer
        made from ``model`` points at them still); ``model`` keeps meta placeholders of them."""
        tensors = [*model.parameters(), *model.buffers()]
        owned = copy.deepcopy(model, {id(t): t for t in tensors})
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                setattr(module, name, torch.empty_like(b, device="meta"))
        return owned

    def build(self, old: nn.Module, device: torch.device) -> tuple[nn.Module, dict[int, nn.Parameter]]:
        """A fresh unsharded copy on ``device`` (its parameters allocated, not set: a restore fills them) and each
        of ``old``'s parameters by id -> the fresh one of its name (the optimizer follows); ``old``'s memory is
        released at once."""
        fresh = copy.deepcopy(self._model)
        fresh.to_empty(device=device)
        with torch.no_grad():
            for (_, buffer), (_, kept) in zip(fresh.named_buffers(), self._model.named_buffers(), strict=True):
                buffer.copy_(kept)
        by_name = dict(fresh.named_parameters())
        moved = {id(p): by_name[name] for name, p in old.named_parameters() if name in by_name}
        old.to_empty(device="meta")
        return fresh, moved


def module_classes(model: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules()})


def check_blocks(model: nn.Module, names: Sequence[str]) -> None:
    """Every name in ``fsdp_blocks`` must be a class of the model's modules."""
    unknown = set(names) - set(module_classes(model))
    if unknown:
        raise ConfigError(f"fsdp_blocks={tuple(names)!r}: {sorted(unknown)} not found in the model. Its module "
                          f"classes are {module_classes(model)}. HINT: name the repeated block, e.g. the "
                          f"transformer layer class.")


def _blocks_by_name(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    check_blocks(model, names)
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _blocks_by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up: a submodule becomes a block when the parameters not already in a block below reach min_params."""
    picked: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        own = sum(p.numel() for p in module.parameters(recurse=False))
        below = sum(visit(child) for child in module.children())
        total = own + below
        if module is not model and total >= min_params:
            picked.append(module)
            return 0
        return total

    visit(model)
    return picked


def pick_blocks(model: nn.Module, blocks: Sequence[str] | None, min_params: int) -> list[nn.Module]:
    """The model's blocks: its modules of the classes ``blocks`` names, else by size (``min_params``)."""
    return _blocks_by_name(model, blocks) if blocks else _blocks_by_size(model, min_params)


ONE_PROCESS_NOTE = ("trainstack: strategy='fsdp' (or 'hsdp') on one process: nothing to shard, the model is trained "
                    "whole (checkpoints are still sharded DCP folders, which resume on any number of processes).")


def shard(model: nn.Module, mesh: DeviceMesh, blocks: Sequence[str] | None = None, min_params: int = 1_000_000,
          param_dtype: torch.dtype | None = None, compile_options: dict | None = None) -> nn.Module:
    """``fully_shard`` each block, then the root, over ``mesh`` (1-D: FSDP; 2-D: HSDP, replicated across its first
    dimension, sharded across its second) -- in place; the same object is returned. With ``compile_options``,
    each block is compiled (in place) before it is sharded, as torchtitan does -- the root itself when there is no
    block."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    picked = pick_blocks(model, blocks, min_params)
    if compile_options is not None:
        from .compiling import compile_in_place

        compile_in_place(model, compile_options, picked)
    for block in picked:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_state(model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective: the whole (unsharded) model and optimizer state on the CPU, as a plain model would have them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with _quiet_redistribute():
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return model_sd, optim_sd


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """Gathering an FSDP + tensor-parallel state whole, torch warns on every rank that it takes "2 sequential
    all_gather operations" for a strided shard: true, expected for this one gather at the end, and nothing the user
    can act on -- so it is not printed (torch's own logger, for this call only)."""
    import logging

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def fqn_optimizer_to_indexed(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter names (DCP's full form) -> torch's usual integer keys."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for name in group["params"]:
            index.setdefault(name, len(index))
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items() if name in index},
            "param_groups": groups}

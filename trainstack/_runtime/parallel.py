"""How the processes split the work for models that outgrow one device: the device mesh (data-parallel replicas x
shards x tensor-parallel), activation checkpointing, and the user's parallelize hook.

The mesh's dimensions, outermost first: ``dp_replicate`` (HSDP: full copies, one per node by default),
``dp_shard`` (FSDP: parameters split across these ranks) and ``tp`` (the user's tensor-parallel plan, innermost, so
a TP group stays inside a node). Order of application, torchtitan's: the parallelize hook (TP) -> activation
checkpointing -> compile -> ``fully_shard``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .._common.choices import SHARDING, check_int
from ..errors import ConfigError
from . import groupsockets

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Parallelism", "Layout", "plan_layout", "lay_out", "HSDP_ONE_REPLICA_NOTE", "AC_POLICIES",
           "checkpoint_activations", "parallelize"]

HSDP_ONE_REPLICA_NOTE = ("trainstack: strategy='hsdp' with one replica (one node, or hsdp_replicas=1) shards over "
                         "every process: it is FSDP. HINT: hsdp_replicas=N for N copies.")
AC_POLICIES = ("full", "selective")


@dataclass(frozen=True)
class Parallelism:
    """What, beyond the strategy, splits a model across processes: HSDP's replicas, the tensor-parallel size and
    the user's hook that applies it, activation checkpointing. Checked here, once, for TrainConfig and
    Accelerator alike."""

    hsdp_replicas: int | None = None
    tensor_parallel_size: int = 1
    parallelize_fn: Callable[..., Any] | None = None
    activation_checkpointing: str | Callable[[nn.Module], bool] | None = None
    float8: bool = False  # mixed_precision="fp8": the Linear layers train in float8 (torchao), the rest in bf16

    def __post_init__(self) -> None:
        for name, minimum in (("hsdp_replicas", 1), ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
        if self.parallelize_fn is not None and not callable(self.parallelize_fn):
            raise ConfigError(f"parallelize_fn={self.parallelize_fn!r} must be a function (model, mesh, tp_mesh).")
        ac = self.activation_checkpointing
        if ac is not None and not callable(ac) and ac not in AC_POLICIES:
            raise ConfigError(f"activation_checkpointing={ac!r} must be 'full', 'selective', a function "
                              f"(module) -> bool, or None.")
        if self.tensor_parallel_size > 1 and self.parallelize_fn is None:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} needs parallelize_fn: your "
                              f"tensor-parallel plan, applied to the model with the 'tp' mesh it receives "
                              f"(docs/how-to/fsdp.md).")

    def check_config(self, strategy: str, blocks: object, min_params: object) -> tuple[str, ...] | None:
        """``TrainConfig``'s parallel plan checked by its owner: the strategy's combinations, the FSDP wrap
        settings (``fsdp_blocks``: module class names, returned as a tuple; ``fsdp_min_params``: an integer >= 1)
        that apply only where something shards or checkpoints activations."""
        check_int("fsdp_min_params", min_params, minimum=1)
        if blocks is not None and (isinstance(blocks, str) or not isinstance(blocks, (list, tuple))
                                   or not all(isinstance(b, str) for b in blocks)):
            raise ConfigError(f"TrainConfig.fsdp_blocks={blocks!r} must be a tuple of module class names, e.g. "
                              f"('TransformerEncoderLayer',).")
        if (blocks or min_params != 1_000_000) and strategy not in SHARDING and self.activation_checkpointing is None:
            raise ConfigError(f"TrainConfig.fsdp_blocks/fsdp_min_params only apply with strategy='fsdp' or 'hsdp' "
                              f"(strategy={strategy!r}) or activation_checkpointing.")
        self.check_strategy(strategy)
        return tuple(blocks) if isinstance(blocks, (list, tuple)) else None

    def check_strategy(self, strategy: str) -> None:
        """The combinations a strategy cannot run, said before any process starts."""
        if self.hsdp_replicas is not None and strategy != "hsdp":
            raise ConfigError(f"hsdp_replicas={self.hsdp_replicas} only applies with strategy='hsdp' (strategy="
                              f"{strategy!r}).")
        if self.tensor_parallel_size > 1 and strategy == "ddp":
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} with strategy='ddp': DDP cannot "
                              f"hold tensor-parallel (DTensor) parameters. HINT: strategy='fsdp' or 'hsdp' (FSDP over "
                              f"the data-parallel ranks, your plan over 'tp').")


@dataclass(frozen=True)
class Layout:
    """The world as ``replicate x shard x tp`` ranks (their product is the world size)."""

    replicate: int
    shard: int
    tp: int

    @property
    def data_world(self) -> int:
        """How many different batches one step sees: every rank of a TP group reads the same one."""
        return self.replicate * self.shard

    def data_rank(self, rank: int) -> int:
        """Which of them ``rank`` reads (the TP dimension is innermost)."""
        return rank // self.tp

    def mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        dims = [(n, size) for n, size in (("dp_replicate", self.replicate), ("dp_shard", self.shard),
                                          ("tp", self.tp)) if size > 1 or n == "dp_shard"]
        return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh FSDP shards over: ``dp_shard``, with ``dp_replicate`` in front under HSDP (a 2-D mesh
        makes ``fully_shard`` replicate across its first dimension)."""
        return mesh["dp_replicate", "dp_shard"] if self.replicate > 1 else mesh["dp_shard"]


def plan_layout(strategy: str, world: int, nodes: int, hsdp_replicas: int | None, tp: int) -> Layout:
    """The layout a configuration asks for on ``world`` processes over ``nodes`` nodes; a clear error when the
    sizes do not divide."""
    if world % tp:
        raise ConfigError(f"tensor_parallel_size={tp} does not divide the {world} processes. HINT: a divisor of "
                          f"the processes per node, e.g. {_divisors(world)}.")
    data = world // tp
    if strategy != "hsdp":
        return Layout(1, data, tp) if strategy == "fsdp" else Layout(data, 1, tp)
    replicas = hsdp_replicas if hsdp_replicas is not None else max(nodes, 1)
    if data % replicas:
        raise ConfigError(f"hsdp_replicas={replicas} does not divide the {data} data-parallel processes "
                          f"({world} processes / tensor_parallel_size={tp}). HINT: hsdp_replicas in "
                          f"{_divisors(data)} (default: the number of nodes, {nodes}).")
    return Layout(replicas, data // replicas, tp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def checkpoint_activations(model: nn.Module, policy: str | Callable[[nn.Module], bool],
                           blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Activation checkpointing (non-reentrant; the state-dict keys do not change): ``full`` on every block,
    ``selective`` on every second one (torchtitan's layer-selective policy), or on every submodule for which
    ``policy(module)`` is true. The checkpointed modules are returned."""
    if callable(policy):
        chosen = [m for m in model.modules() if m is not model and policy(m)]
    elif policy == "full":
        chosen = list(blocks)
    else:
        chosen = list(blocks)[::2]
    for module in chosen:
        _recompute_in_backward(module)
    return chosen


def _recompute_in_backward(module: nn.Module) -> None:
    """The module's own ``forward`` runs under ``torch.utils.checkpoint`` (RNG state preserved, so dropout masks
    match): inside the forward, so a compiled module traces the checkpoint as part of its graph and FSDP's
    gather/free hooks stay around it (torch's composable ``checkpoint`` hooks do not survive ``module.compile``)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


def parallelize(fn: Callable[..., Any], model: nn.Module, mesh: DeviceMesh | None, layout: Layout) -> nn.Module:
    """The user's hook: ``fn(model, mesh, tp_mesh)`` applies its own plan (tensor parallelism, a custom sharding)
    before trainstack shards; it may return a new model (None: the mesh of one process without a process group).
    Its errors name the hook and the mesh."""
    import warnings

    tp_mesh = mesh["tp"] if mesh is not None and layout.tp > 1 else None
    name = getattr(fn, "__name__", repr(fn))
    where = f"mesh {mesh.mesh_dim_names} {tuple(mesh.shape)}" if mesh is not None else "one process"
    hint = (f"HINT: a tensor-parallel plan names the model's own submodules ({_some_names(model)}) and uses "
            f"tp_mesh.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(model, mesh, tp_mesh)
        except Exception as exc:
            raise ConfigError(f"parallelize_fn {name!r} failed on {where}: {type(exc).__name__}: {exc}. "
                              f"{hint}") from exc
    unresolved = [str(w.message).split(" in module")[0] for w in caught if "could not be resolved" in str(w.message)]
    for w in caught:
        if "could not be resolved" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if unresolved:  # torch only warns and skips: a plan that does not match the model trains unsplit
        raise ConfigError(f"parallelize_fn {name!r}: its plan does not match the model: {'; '.join(unresolved)}. "
                          f"{hint}")
    model = out if isinstance(out, nn.Module) else model
    if layout.tp > 1 and not any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ConfigError(f"parallelize_fn {name!r} split no parameter over tp_mesh (tensor_parallel_size="
                          f"{layout.tp}): every process would train the whole model. {hint}")
    return model


#: fp8 pays for large matrix products only: below this smaller dimension, float8's casts and scales cost more than
#: its faster GEMMs save (torchao's own tables; a 4-layer d=2048 GPT ran at 0.56x bf16 eager on an H200).
FP8_MIN_DIM = 4096


def fp8_note(shapes: list[tuple[int, int]], compiled: bool) -> str | None:
    """What to say before an fp8 run that will likely be slower than bf16 (None when it should pay)."""
    if not shapes:
        return ("mixed_precision='fp8' found no Linear layer whose sizes are multiples of 16: nothing runs in fp8, "
                "the run is bf16 with float8's bookkeeping. HINT: mixed_precision='bf16'.")
    largest = max(min(s) for s in shapes)
    why = []
    if not compiled:
        why.append("without compile, float8's scaling runs as separate kernels (0.56x bf16 measured on an H200)")
    if largest < FP8_MIN_DIM:
        why.append(f"its largest Linear is {largest} wide, under the ~{FP8_MIN_DIM} where float8 GEMMs pay")
    if not why:
        return None
    return (f"mixed_precision='fp8' will likely be slower than bf16 here: {'; and '.join(why)}. HINT: compile=True "
            f"with layers of {FP8_MIN_DIM}+ (bench/llm.py --precision bf16,fp8 measures it), else "
            f"mixed_precision='bf16'.")


def to_float8(model: nn.Module, device_type: str, sharded: bool = False) -> list[tuple[int, int]]:
    """``mixed_precision="fp8"``: torchao's float8 training for every Linear whose sizes fp8 kernels take
    (multiples of 16), in place; a clear error where fp8 cannot run (a CPU, a GPU before Hopper/Ada, no torchao).
    ``sharded`` (FSDP2/HSDP over several processes): the weights are all-gathered in float8, half bf16's bytes,
    where torchao offers it (``enable_fsdp_float8_all_gather``, as torchtitan does). The converted layers' sizes."""
    import importlib.util

    import torch

    if device_type != "cuda":
        raise ConfigError(f"mixed_precision='fp8' needs an NVIDIA GPU with float8 tensor cores (compute capability "
                          f">= 8.9: H100, H200, L40S, B200); this run is on {device_type}. HINT: "
                          f"mixed_precision='bf16'.")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise ConfigError(f"mixed_precision='fp8': {torch.cuda.get_device_name()} (compute capability "
                          f"{capability[0]}.{capability[1]}) has no float8 tensor cores (>= 8.9 needed: Hopper, "
                          f"Ada, Blackwell). HINT: mixed_precision='bf16'.")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("mixed_precision='fp8' trains through torchao's float8, which is not installed. HINT: "
                          "pip install torchao (the build matching your torch).")
    from torchao.float8 import convert_to_float8_training

    options = {}
    if sharded:
        try:
            from torchao.float8 import Float8LinearConfig

            options["config"] = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        except (ImportError, TypeError):  # an older torchao: bf16 all-gathers, still float8 GEMMs
            pass

    def takes(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0

    shapes = [(m.in_features, m.out_features) for name, m in model.named_modules() if takes(m, name)]
    convert_to_float8_training(model, module_filter_fn=takes, **options)
    return shapes


def _some_names(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n]
    return ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")


def lay_out(model: nn.Module, layout: Layout, parallelism: Parallelism, strategy: str, device_type: str,
            is_main: bool, blocks: tuple[Sequence[str] | None, int],
            compiled: bool = False) -> tuple[nn.Module, DeviceMesh | None]:
    """Before compile and sharding, in torchtitan's order: the mesh (collective; for FSDP/HSDP or a parallelize
    hook), the user's hook, then activation checkpointing of the blocks (``blocks``: ``fsdp_blocks`` and
    ``fsdp_min_params``) or of the modules the policy picks."""
    import torch.distributed as dist

    from .fsdp import pick_blocks

    world = layout.replicate * layout.shard * layout.tp
    wanted = (strategy != "ddp" and world > 1) or parallelism.parallelize_fn is not None
    mesh = None
    if dist.is_initialized() and wanted:
        with groupsockets.opening(gloo=dist.get_backend() == "gloo"):  # shut down if this rank leaves them failed
            mesh = layout.mesh(device_type)
    if strategy == "hsdp" and layout.replicate == 1 and world > 1 and is_main:
        print(HSDP_ONE_REPLICA_NOTE, flush=True)
    if parallelism.float8:
        note = fp8_note(to_float8(model, device_type, sharded=strategy != "ddp" and world > 1), compiled)
        if note and is_main:
            import logging

            logging.getLogger("trainstack").warning(note)
    if parallelism.parallelize_fn is not None:
        model = parallelize(parallelism.parallelize_fn, model, mesh, layout)
    policy = parallelism.activation_checkpointing
    picked = pick_blocks(model, *blocks) if policy is not None and not callable(policy) else []
    if policy is not None and not checkpoint_activations(model, policy, picked) and is_main:
        import logging

        logging.getLogger("trainstack").warning(
            "activation_checkpointing=%r found no block to checkpoint. HINT: fsdp_blocks=('YourBlock',) names the "
            "repeated block (by default: modules of fsdp_min_params parameters).", policy)
    return model, mesh

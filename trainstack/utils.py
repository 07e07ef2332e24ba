"""Accelerate's ``accelerate.utils`` path for what trainstack provides: ``from accelerate.utils import X`` becomes
``from trainstack.utils import X`` (docs/migration/accelerate.md has the table, with what is not supported and
what to use instead). Collectives take nested tensors and are identities on one process."""

from ._accelerate.config import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
)
from ._accelerate.logs import tqdm
from ._accelerate.ops import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    copy_tensor_to_devices,
    find_executable_batch_size,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    synchronize_rng_states,
    wait_for_everyone,
)
from ._accelerate.probes import (
    is_bf16_available,
    is_cuda_available,
    is_datasets_available,
    is_fp16_available,
    is_hpu_available,
    is_mlflow_available,
    is_mps_available,
    is_npu_available,
    is_pytest_available,
    is_tensorboard_available,
    is_torch_xla_available,
    is_transformers_available,
    is_wandb_available,
    is_xpu_available,
)
from ._accelerate.state import DistributedType
from .accelerator import set_seed

__all__ = [
    "DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration", "DistributedDataParallelKwargs",
    "InitProcessGroupKwargs", "GradScalerKwargs", "KwargsHandler", "DistributedType", "DDPCommunicationHookType",
    "ProfileKwargs", "AutocastKwargs",
    "DistributedOperationException", "gather", "gather_object", "broadcast", "broadcast_object_list", "reduce",
    "pad_across_processes", "send_to_device", "synchronize_rng_states", "copy_tensor_to_devices",
    "recursively_apply", "find_executable_batch_size", "set_seed", "tqdm", "wait_for_everyone",
    "is_bf16_available", "is_cuda_available", "is_datasets_available", "is_fp16_available", "is_hpu_available",
    "is_mlflow_available", "is_mps_available", "is_npu_available", "is_pytest_available",
    "is_tensorboard_available", "is_torch_xla_available", "is_transformers_available", "is_wandb_available",
    "is_xpu_available",
]

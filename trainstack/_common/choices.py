"""Values shared by the runtime and the script generator (one source): the allowed settings of `TrainConfig`,
`Accelerator` and the CLI, and the rendezvous port formula."""

from __future__ import annotations

COMPUTE_SETUPS = ("auto", "gpu", "cpu")
BACKENDS = (None, "nccl", "gloo", "mpi")
LOG_SETUPS = ("cpu", "auto")
MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")
TRACKING_TOOLS = ("jsonl", "tensorboard", "mlflow", "wandb")
STRATEGIES = ("ddp", "fsdp", "hsdp")
#: The strategies that shard with FSDP2 (``hsdp``: over a 2-D mesh, replicated across its first dimension).
SHARDING = ("fsdp", "hsdp")
CHECKPOINT_FORMATS = ("auto", "file", "sharded")

#: Defaults shared by TrainConfig and Accelerator (qadence differs between its two; we do not).
DEFAULT_COMPUTE_SETUP = "auto"

#: Ports derived from a Slurm job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN): above Linux's default ephemeral
#: range (32768-60999), so they do not collide with ports the kernel hands out. Same formula as NVIDIA enroot's
#: PyTorch hook; used by ``environment.port_from_job_id`` and by the generated sbatch scripts.
PORT_BASE = 61000
PORT_SPAN = 4536


def check_int(name: str, value: object, minimum: int) -> None:
    """``TrainConfig.<name>`` is an integer of at least ``minimum`` (a ``ConfigError`` naming it otherwise)."""
    from ..errors import ConfigError

    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"TrainConfig.{name}={value!r} must be an integer >= {minimum}.")

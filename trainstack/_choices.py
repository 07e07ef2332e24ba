"""The allowed values of the settings shared by `TrainConfig`, `Accelerator` and the CLI (one source)."""

from __future__ import annotations

COMPUTE_SETUPS = ("auto", "gpu", "cpu")
BACKENDS = (None, "nccl", "gloo", "mpi")
LOG_SETUPS = ("cpu", "auto")
MIXED_PRECISION = ("no", "bf16", "fp16")
TRACKING_TOOLS = ("jsonl", "tensorboard", "mlflow")

#: Defaults shared by TrainConfig and Accelerator (qadence differs between its two; we do not).
DEFAULT_COMPUTE_SETUP = "auto"

"""Accelerate's ``is_*_available`` questions, answered for this machine: a package is available when it can be
imported; a device kind when torch sees one; a precision when the device runs it (bf16 and fp16 autocast run on
every CPU torch supports)."""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["is_package_available", "is_cuda_available", "is_bf16_available", "is_fp16_available"]


def is_package_available(name: str) -> bool:
    """Whether ``import name`` would find the package (a broken parent package counts as absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available(min_version: str | None = None) -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    return True


def is_hpu_available(init_hccl: bool = False) -> bool:
    return False  # Gaudi: not a device trainstack runs on


def is_npu_available(check_device: bool = False) -> bool:
    return False  # Ascend: not a device trainstack runs on


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    return False  # TPUs: not supported


def is_datasets_available() -> bool:
    return is_package_available("datasets")


def is_transformers_available() -> bool:
    return is_package_available("transformers")


def is_pytest_available() -> bool:
    return is_package_available("pytest")


def is_tensorboard_available() -> bool:
    return is_package_available("tensorboard")


def is_mlflow_available() -> bool:
    return is_package_available("mlflow")


def is_wandb_available() -> bool:
    return is_package_available("wandb")

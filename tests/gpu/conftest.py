"""The GPU lane: every test here needs CUDA and is skipped without it (`make test-gpu` runs only this folder)."""

from __future__ import annotations

import os

import pytest
import torch

# cuBLAS picks algorithms deterministically only with a fixed workspace; set before any CUDA matmul runs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="no CUDA device: the GPU lane runs on a GPU machine (make test-gpu)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)

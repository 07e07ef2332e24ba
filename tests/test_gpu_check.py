"""scripts/gpu-check.sh, the GPU lane in one call, dry-run where there is no CUDA: every part runs or says why it
was skipped, and the report is written -- so the script cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script is the GPU lane itself")


def test_the_gpu_check_dry_runs_without_cuda_and_reports_every_part(run_py, tmp_path):
    report = tmp_path / "out" / "gpu-check.md"
    proc = run_py(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(report)], timeout=240,
                  env={"PYTHON": sys.executable, "GPU_CHECK_BUDGET": "200"})
    text = report.read_text()
    table = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| part")}
    assert table.pop("facts") == "passed" and table.pop("trainstack doctor") == "passed", text
    assert table.pop("test-gpu (tests/gpu)") == "passed", text  # collected and skipped with their reason
    assert set(table.values()) == {"skipped: no CUDA device here"}, table
    assert {"nccl_check", "compile cold vs warm", "fp8 probe", "llm 1b bf16 compile (raw, trainer)",
            "llm 8b-proxy bf16 vs fp8 compile (trainer)", "memory checkpoint stall"} <= set(table), table
    assert "skipped" in (tmp_path / "out" / "gpu-check.log").read_text() and "report:" in proc.stdout
    assert f"torch {torch.__version__}" in text and "python-hostlist" in text


def test_a_spent_budget_skips_the_remaining_parts_and_says_so(run_py, tmp_path):
    report = tmp_path / "gpu-check.md"
    run_py(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(report)], timeout=120,
           env={"PYTHON": sys.executable, "GPU_CHECK_BUDGET": "5"})
    assert "skipped: the 5 s budget is spent" in report.read_text()

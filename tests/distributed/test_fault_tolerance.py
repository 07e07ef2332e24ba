"""Worker failure under torchrun --max-restarts: the group restarts, resumes from the last checkpoint, and ends
with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import torchrun_exe
from psutil_free import own_children

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = str(Path(__file__).with_name("_restart_train.py"))


def _torchrun(run_py, out, mode):
    out.mkdir()
    return run_py([torchrun_exe(), "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                   "--monitor-interval", "0.5", SCRIPT, str(out), mode], timeout=240)


def test_killed_worker_restarts_and_resumes_to_the_reference_result(run_py, tmp_path):
    _torchrun(run_py, tmp_path / "ref", "ref")
    start = time.monotonic()
    proc = _torchrun(run_py, tmp_path / "kill", "kill")
    total = time.monotonic() - start
    killed = float((tmp_path / "kill" / "killed_at").read_text())
    resumed_at, step = (tmp_path / "kill" / "resumed_at").read_text().split()
    print(f"fault -> training resumed: {float(resumed_at) - killed:.1f}s (from step {step}); run {total:.1f}s")
    assert "Resumed from" in proc.stdout and int(step) < 30
    ref = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "kill" / "final.pt", weights_only=True)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert not own_children()

"""The Python API sends a function to the real Slurm and returns its result (like nntool's slurm_fn)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from trainstack.submit import SubmitError, submit_function

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(200)]
HERE = str(Path(__file__).parent)


def test_function_result_comes_back(slurm_env, shared_tmp, monkeypatch):
    from _remote_fns import fails, square_on_the_cluster

    for k, v in slurm_env.items():
        monkeypatch.setenv(k, v)
    common = dict(cpu=True, time="5", log_dir=str(shared_tmp), python=sys.executable, env={"PYTHONPATH": HERE},
                  job_name="trainstack-test")
    job = submit_function(square_on_the_cluster, args=(7,), **common)
    folder = job.result_path.parent  # a private folder inside the (world-writable) log_dir
    assert folder.parent == shared_tmp and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "call.pkl").stat().st_mode) == 0o600
    out = job.result(timeout=150)
    assert out["value"] == 49 and out["job"] == job.job_id and out["node"] in ("node1", "node2")
    assert stat.S_IMODE(job.result_path.stat().st_mode) == 0o600
    bad = submit_function(fails, **common)
    with pytest.raises(SubmitError, match="failure inside the job"):
        bad.result(timeout=150)

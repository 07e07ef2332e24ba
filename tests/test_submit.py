"""The I/O half of the generator without a cluster: scripts written atomically, function results trusted only
from the job's private folder."""

from __future__ import annotations

import os
import pickle
import stat

import pytest

from trainstack._common.files import atomic_write, private_dir
from trainstack.submit import FunctionJob, SubmitError, write_script


def test_write_script_is_executable_and_atomic(tmp_path):
    path = write_script(tmp_path / "deep" / "job.sbatch", "#!/bin/bash\n")
    assert path.read_text() == "#!/bin/bash\n" and stat.S_IMODE(path.stat().st_mode) == 0o755
    assert [p.name for p in path.parent.iterdir()] == ["job.sbatch"]


class _Evil:
    def __init__(self, canary):
        self.canary = str(canary)

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_result_planted_by_another_user_is_refused(tmp_path):
    folder = private_dir(tmp_path, prefix="job-")
    canary = tmp_path / "CANARY"
    result = atomic_write(folder / "result.pkl", pickle.dumps(_Evil(canary)), mode=0o600)
    os.chown(result, 65534, 65534)
    job = FunctionJob("1", folder / "job.sbatch", folder / "job-1.out", exit_code=0, result_path=result)
    with pytest.raises(SubmitError, match="refusing to load"):
        job.result()
    assert not canary.exists()


def test_array_ranges_and_exit_codes():
    from trainstack._common.text import number_ranges as _ranges_text
    from trainstack._slurm.status import exit_status

    def _ranges(numbers):
        return _ranges_text(numbers, ",")

    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and _ranges([3]) == "3"
    assert exit_status("COMPLETED") == 0 and exit_status("FAILED (exit 3:0)") == 3
    assert exit_status("CANCELLED (exit 0:15)") == 143 and exit_status("FAILED (exit 2)") == 2
    assert exit_status("ENDED (killed: no exit status recorded)") == 1


def test_an_absolute_program_in_the_repository_runs_from_the_snapshot(tmp_path):
    from trainstack._slurm.submission import _program_in_snapshot
    from trainstack.render import LaunchSpec

    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    spec = LaunchSpec(cpu=True, program=[str(repo / "train.py"), str(repo / "data.bin")], chdir=str(repo / "sub"))
    moved = _program_in_snapshot(spec, repo)
    assert moved.program == ["../train.py", str(repo / "data.bin")]  # the program moves, arguments do not
    outside = LaunchSpec(cpu=True, program=["/opt/tools/train.py"], chdir=str(repo))
    assert _program_in_snapshot(outside, repo).program == ["/opt/tools/train.py"]
    shell = LaunchSpec(cpu=True, program=["bash", str(repo / "run.sh")], chdir=str(repo), program_kind="exec")
    assert _program_in_snapshot(shell, repo).program == ["bash", "run.sh"]

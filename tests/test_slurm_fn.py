"""nntool's slurm_fn/SlurmConfig without a cluster: debug and local modes, the generated spec, clear errors
(on Slurm: tests/slurm/test_nntool.py)."""

from __future__ import annotations

import sys

import pytest

from trainstack import render
from trainstack.errors import ConfigError
from trainstack.render import LaunchSpec
from trainstack.slurm import SlurmConfig, slurm_fn


@slurm_fn
def add(a, b=1):
    return a + b


def test_debug_runs_here_and_local_runs_the_job_runner_in_a_subprocess(tmp_path, monkeypatch):
    import os
    from pathlib import Path

    here = str(Path(__file__).parent)  # the job runner imports this module to find `add`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    assert add(1, b=2) == 3  # undecorated call: the function itself
    assert add[SlurmConfig(mode="debug")](4).result() == 5
    job = add[{"mode": "local", "output_parent_path": str(tmp_path)}](10, b=5)
    assert job.result() == 15 and job.state == "COMPLETED"
    assert list((tmp_path / "slurm").glob("Job-local-*/log.out"))


def test_the_config_becomes_one_launch_spec_and_script():
    config = SlurmConfig(mode="slurm", partition="gpu", job_name="exp", num_of_node=2, tasks_per_node=1,
                         cpus_per_task=8, gpus_per_node=4, processes_per_task=4, mem="192GB", node_list="node[1-2]",
                         use_distributed_env=True, timeout_min=90,
                         distributed_launch_command="accelerate launch --num_processes {num_processes} "
                                                    "--num_machines {num_machines} --machine_rank {machine_rank} "
                                                    "--main_process_ip {main_process_ip} --main_process_port "
                                                    "{main_process_port} main.py")
    script = render(LaunchSpec(python=sys.executable, **config.launch_spec()))
    for line in ("#SBATCH --partition=gpu", "#SBATCH --nodes=2", '#SBATCH --nodelist="node[1-2]"',
                 "#SBATCH --time=01:30:00", "#SBATCH --mem=192GB", "TRAINSTACK_SLURM_FN=1", "accelerate launch"):
        assert line in script, line


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"mode": "cluster"}, "SlurmConfig.mode='cluster'"),
    ({"num_of_node": 0}, "num_of_node=0"),
    ({"use_distributed_env": True}, "distributed_launch_command"),
    ({"node_list_exclude": "n3"}, "node_list_exclude"),
    ({"pack_code": True}, "snapshots the code"),
])
def test_bad_configs_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        SlurmConfig(**kwargs)


def test_a_non_config_in_brackets_is_clear():
    with pytest.raises(ConfigError, match="takes a SlurmConfig"):
        add["slurm"]

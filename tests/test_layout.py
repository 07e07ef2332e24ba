"""The process layout: plans from environments and nprocs, and the one place a worker's identity is built."""

from __future__ import annotations

import pytest
from test_environment import SLURM_STEP, TORCHRUN

from trainstack._runtime.layout import plan_processes
from trainstack.environment import LocalEnvironment, detect_environment
from trainstack.errors import LaunchError


def test_plan_local():
    plan = plan_processes(LocalEnvironment(), 4)
    assert (plan.world_size, plan.nprocs_local, plan.spawn, plan.hosts_store) == (4, 4, True, True)
    single = plan_processes(LocalEnvironment(), 1)
    assert (single.world_size, single.spawn) == (1, False)


def test_plan_torchrun_ignores_nprocs():
    env = detect_environment(TORCHRUN)
    plan = plan_processes(env, 8)
    assert (plan.world_size, plan.nprocs_local, plan.rank_offset, plan.spawn) == (4, 1, 2, False)


def test_plan_slurm_one_task_per_process():
    env = detect_environment(SLURM_STEP)
    for nprocs in (1, 4):
        plan = plan_processes(env, nprocs)
        assert (plan.world_size, plan.rank_offset, plan.spawn) == (4, 3, False)


def test_plan_slurm_one_task_per_node_spawns_its_share():
    # seeds: sbatch --nodes=2 --ntasks=2; srun python train.py --nprocs 4
    environ = SLURM_STEP | {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                            "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1",
                            "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
    plan = plan_processes(detect_environment(environ), 4)
    assert (plan.world_size, plan.nprocs_local, plan.rank_offset, plan.local_rank_offset) == (4, 2, 2, 0)
    assert plan.spawn and not plan.hosts_store
    first = plan_processes(detect_environment(environ | {"SLURM_PROCID": "0", "SLURM_NODEID": "0"}), 4)
    assert first.rank_offset == 0 and first.hosts_store


@pytest.mark.parametrize("nprocs, needle", [(3, "nprocs=3 is not a multiple of the 4 Slurm tasks"),
                                            (2, "nprocs=2 is not a multiple"),
                                            (0, "positive integer"), (True, "positive integer")])
def test_plan_slurm_mismatch_is_a_clear_error(nprocs, needle):
    with pytest.raises(LaunchError, match=needle):
        plan_processes(detect_environment(SLURM_STEP), nprocs)


def test_context_is_the_one_identity_record():
    plan = plan_processes(detect_environment(SLURM_STEP | {"SLURM_PROCID": "1", "SLURM_NODEID": "0",
                                                           "SLURM_LOCALID": "1"}), 8)
    ctx = plan.context(1, "cuda", gpus=4, port=1234)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.master_port, ctx.environment) == (
        plan.rank_offset + 1, plan.local_rank_offset + 1, 8, 1234, "slurm")
    assert ctx.device == f"cuda:{(plan.local_rank_offset + 1) % 4}" and not ctx.is_main
    assert plan_processes(LocalEnvironment(), 1).context().device == "cpu"

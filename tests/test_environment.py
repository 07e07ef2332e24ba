"""Environment detection and process planning from explicit variable tables (real-world values)."""

from __future__ import annotations

import pytest

from trainstack.environment import (
    LocalEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    detect_environment,
    expand_nodelist,
    port_from_job_id,
)
from trainstack.errors import LaunchError

# Captured from `srun` on the local 2-node cluster (sbatch --nodes=2 --ntasks-per-node=2), task 3.
SLURM_STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
}
# The batch shell of the same job: SLURM_PROCID=0 and SLURM_NTASKS=4 but no job step.
SLURM_BATCH = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")} | {
    "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
# torchrun --nnodes 2 --nproc-per-node 2 (c10d), worker with global rank 2 on the second agent.
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "4242", "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
}


@pytest.mark.parametrize("nodelist, expected", [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("juwels[07-08]i", ["juwels07i", "juwels08i"]),
    ("n[1-2]-ib,login", ["n1-ib", "n2-ib", "login"]),
    ("a[009-011]", ["a009", "a010", "a011"]),
])
def test_nodelists_expand_like_scontrol(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_bad_nodelist_names_the_value():
    with pytest.raises(LaunchError, match=r"node\[1-"):
        expand_nodelist("node[1-")


def test_priority_torchrun_over_slurm_over_local():
    assert isinstance(detect_environment({}), LocalEnvironment)
    assert isinstance(detect_environment(SLURM_STEP), SlurmEnvironment)
    assert isinstance(detect_environment(TORCHRUN), TorchrunEnvironment)
    # srun torchrun: both sets present, torchrun's describe the workers
    assert isinstance(detect_environment(SLURM_STEP | TORCHRUN), TorchrunEnvironment)


def test_batch_shell_is_not_a_slurm_step():
    assert isinstance(detect_environment(SLURM_BATCH), LocalEnvironment)


def test_slurm_step_fields():
    env = detect_environment(SLURM_STEP)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.node_rank, env.num_nodes, env.job_id) == (1, 2, "4242")
    assert env.master_addr == "node1" and env.nodes == ("node1", "node2")
    assert env.master_port == port_from_job_id(4242) == 61000 + 4242 % 4536
    assert env.restart_count == 0


def test_slurm_master_overrides_and_restart_count():
    env = detect_environment(SLURM_STEP | {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "12345",
                                           "SLURM_RESTART_COUNT": "2"})
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.5", 12345, 2)


def test_slurm_uneven_tasks_per_node():
    environ = SLURM_STEP | {"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "0", "SLURM_PROCID": "2",
                            "SLURM_LOCALID": "2"}
    assert detect_environment(environ).local_world_size == 3


def test_job_ids_of_arrays_and_hetjobs_give_ports_in_range():
    for job_id in ("1", "123456789", "77_3", "4536"):
        assert 61000 <= port_from_job_id(job_id) < 61000 + 4536


def test_torchrun_fields():
    env = detect_environment(TORCHRUN)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 4, 0, 2)
    assert (env.node_rank, env.num_nodes, env.restart_count) == (1, 2, 1)
    assert (env.master_addr, env.master_port) == ("node1", 29500)


def test_manual_env_launch_counts_as_torchrun():
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1234"}
    env = detect_environment(environ)
    assert env.name == "torchrun" and env.rank == 1


@pytest.mark.parametrize("environ, needle", [
    (TORCHRUN | {"RANK": "two"}, "RANK='two'"),
    (TORCHRUN | {"RANK": "7"}, "rank 7 not in"),
    (SLURM_STEP | {"SLURM_NTASKS": "x", "SLURM_STEP_NUM_TASKS": ""}, "SLURM_NTASKS='x'"),
    (SLURM_STEP | {"SLURM_STEP_TASKS_PER_NODE": "2(y2)"}, "SLURM_STEP_TASKS_PER_NODE"),
])
def test_bad_variables_are_named(environ, needle):
    with pytest.raises(LaunchError) as exc:
        detect_environment(environ)
    assert needle in str(exc.value)


def test_the_job_scripts_process_count_wins_over_the_programs_nprocs(caplog):
    """`--launcher spawn` runs one task per node; the program's own nprocs default (1, or the demo's 2) must not
    leave the allocation's GPUs idle: TRAINSTACK_NPROCS from the generated script decides, with a warning."""
    from trainstack._runtime.layout import plan_processes
    from trainstack.environment import detect_environment

    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "1(x2)", "TRAINSTACK_NPROCS": "8"}
    for nprocs in (1, 2, 8):
        plan = plan_processes(detect_environment(env), nprocs)
        assert (plan.world_size, plan.nprocs_local, plan.rank_offset) == (8, 4, 4)
    srun = {**env, "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
            "TRAINSTACK_NPROCS": "4"}
    plan = plan_processes(detect_environment(srun), 2)  # the demo's default under --launcher srun
    assert (plan.world_size, plan.spawn, plan.rank_offset) == (4, False, 3)


def test_a_step_beside_ranks_restarted_in_place_takes_each_tasks_rank_from_the_driver():
    """TRAINSTACK_TASK_RANKS=PER_NODE/RANKS (the allocation driver's, for a step that starts only the crashed ranks):
    srun's task 1 of 2 is global rank 3 of 4, second on node 1; the world is TRAINSTACK_NPROCS, not the step's."""
    env = detect_environment({"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                              "SLURM_JOB_ID": "7", "MASTER_ADDR": "node1", "MASTER_PORT": "20001",
                              "TRAINSTACK_NPROCS": "4", "TRAINSTACK_TASK_RANKS": "2/2,3"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == \
        (3, 4, 1, 2, 1, 2)
    assert (env.master_addr, env.master_port, env.allocated) == ("node1", 20001, 4)
    with pytest.raises(LaunchError, match=r"TRAINSTACK_TASK_RANKS='2/3'.*SLURM_PROCID='1'.*PER_NODE/RANK"):
        detect_environment({"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                            "TRAINSTACK_NPROCS": "4", "TRAINSTACK_TASK_RANKS": "2/3", "MASTER_PORT": "1"})


@pytest.mark.parametrize("listed", ["0/1", "99999999999999999999/1", "-3/1", "2/9", "2/-1"])
def test_task_ranks_out_of_range_are_a_launch_error(listed):
    """Probe 5 E7 (ZeroDivisionError), E10 (a 1e20 local world accepted), A11 (a negative per-node count)."""
    with pytest.raises(LaunchError, match=r"TRAINSTACK_TASK_RANKS=.*expected PER_NODE/RANK"):
        detect_environment({"SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7",
                            "TRAINSTACK_NPROCS": "4", "TRAINSTACK_TASK_RANKS": listed, "MASTER_PORT": "1"})

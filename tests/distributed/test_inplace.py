"""A restart in place without Slurm: the test sets what srun and the allocation driver would (a Slurm step's
variables per rank, the job folder, ``TRAINSTACK_IN_PLACE=1``) and plays the driver -- it waits for the surviving
rank to say it waits, writes the next step's offer and starts only the killed rank, as a step of one task
(``TRAINSTACK_TASK_RANKS``). The survivor's process trains on and ends the run with parameters bitwise equal to an
uninterrupted run's, with gradient accumulation (its failed step's gradients must not add up), continuing from the
step it completed -- the new rank takes its state, no checkpoint is read (issue 67). The real-Slurm
path: tests/slurm/test_recovery.py; the driver's decisions: tests/test_allocation.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import _free_port

from trainstack._common.jobfiles import JobFiles

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]
PROGRAM = str(Path(__file__).with_name("_inplace_train.py"))


def _task(out: Path, job: Path, rank_of_task: int, tasks: int, port: int, step: int, **extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRAINSTACK_", "MASTER_"))}
    env.update({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": str(step), "SLURM_PROCID": str(rank_of_task),
                "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": str(rank_of_task), "SLURM_NODEID": "0",
                "SLURM_NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TRAINSTACK_JOB_DIR": str(job), "TRAINSTACK_IN_PLACE": "1", "TRAINSTACK_STEP": str(step),
                "TRAINSTACK_ATTEMPT": str(step), "TRAINSTACK_NPROCS": "2", "INPLACE_OUT": str(out), **extra})
    with open(out / f"task-{step}-{rank_of_task}.log", "w") as log:  # a file, not a pipe nobody reads meanwhile
        return subprocess.Popen([sys.executable, PROGRAM], env=env, start_new_session=True, stdout=log,
                                stderr=subprocess.STDOUT)


def _run(out: Path, fault: bool, world: int = 2, **extra: str) -> tuple[dict[str, torch.Tensor], str]:
    """``world`` ranks as one srun task each; with ``fault``, rank 1 is killed (``KILL_RANK=1``) and the others
    continue in place beside a new rank 1."""
    out.mkdir()
    job = out / "job"
    job.mkdir()
    port = _free_port()
    extra = {"TRAINSTACK_NPROCS": str(world), **extra}
    procs = [_task(out, job, r, world, port, 0, **extra) for r in range(world)]
    return _finish(out, job, procs, fault, extra)


def _finish(out: Path, job: Path, procs: list[subprocess.Popen], fault: bool, extra: dict[str, str]):
    world = len(procs)
    survivors = [r for r in range(world) if r != 1]
    try:
        if fault:
            procs[1].wait(timeout=120)
            assert procs[1].returncode == -9, _said(out)
            files, deadline = JobFiles(job), time.monotonic() + 60
            while not set(survivors) <= set(files.step.waiting(0)):
                assert time.monotonic() < deadline and all(procs[r].poll() is None for r in survivors), \
                    f"ranks {survivors} did not wait in place\n{_said(out)}"
                time.sleep(0.05)
            port = _free_port()
            files.step.offer(1, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRAINSTACK_STEP": "1",
                                   "TRAINSTACK_ATTEMPT": "1", "TRAINSTACK_NPROCS": str(world)}, survivors, world)
            procs[1] = _task(out, job, 0, 1, port, 1, **{**extra, "TRAINSTACK_TASK_RANKS": f"{world}/1"})
        for proc in procs:
            proc.wait(timeout=120)
            assert proc.returncode == 0, _said(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return torch.load(out / "final.pt", weights_only=True), _said(out)


def _said(out: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(out.glob("task-*.log")))


def test_a_survivor_continues_in_its_process_and_ends_bitwise_like_an_unfaulted_run(tmp_path):
    """With gradient accumulation (2 batches a step): the survivor's failed step left gradients that a fresh process
    would not have; they must not add to its first resumed step (without clearing them this test fails)."""
    reference, _ = _run(tmp_path / "reference", fault=False, ACCUMULATE="2")
    state, said = _run(tmp_path / "faulted", fault=True, ACCUMULATE="2", KILL_RANK="1", KILL_STEP="5")
    assert "rank 0 lost a peer in job step 0" in said and "rank 0 continues in place in job step 1" in said, said
    pids = (tmp_path / "faulted" / "pid-0").read_text().split()
    assert pids[0] == pids[2] and (pids[1], pids[3]) == ("0", "1"), pids  # one process, in job steps 0 and 1
    # issue 67: no rollback -- the survivor continues from the step it completed (5, the checkpoint is at 4), and
    # the new rank 1 takes that state from it, not from a checkpoint
    assert "Resumed from its own live state at step 5 (no step redone) (epoch 0, step 5" in said, said
    (sent,) = [e for e in JobFiles(tmp_path / "faulted" / "job").events() if e["kind"] == "peer_state"]
    assert sent["step"] == 5 and sent["source_rank"] == 0 and sent["receivers"] == [1] and sent["bytes"] > 0, sent
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)


def test_hsdp_a_killed_rank_takes_its_shard_from_the_other_replica_group_bitwise(tmp_path):
    """HSDP, 2 replica groups x 2 shards (issue 67): rank 1 (group 0, shard 1) killed after step 5; ranks 0, 2, 3
    keep their processes, their models are sharded again over the new group's mesh from their own local shards, and
    the new rank 1 takes shard 1 from rank 3 (group 1) -- no checkpoint read (one at step 4), no step redone, the
    final parameters bitwise equal to an uninterrupted run's."""
    reference, _ = _run(tmp_path / "reference", fault=False, world=4, STRATEGY="hsdp")
    state, said = _run(tmp_path / "faulted", fault=True, world=4, STRATEGY="hsdp", KILL_RANK="1", KILL_STEP="5")
    for rank in (0, 2, 3):
        assert f"rank {rank} continues in place in job step 1" in said, said
    assert "Resumed from its own live state at step 5 (no step redone)" in said, said
    (sent,) = [e for e in JobFiles(tmp_path / "faulted" / "job").events() if e["kind"] == "peer_state"]
    assert sent["step"] == 5 and sent["receivers"] == [1] and sent["sources"] == {"1": 3} and sent["bytes"] > 0, sent
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state)
